"""The CodeBolt agent-to-app gateway (SPEC.md §7): WebSocket `/agent-to-app` + uibus.v1.CodeBoltService."""
