"""Drives a uibus server with the REAL neuro-san client library (run with .venv-neurosan's python).

Usage: python neurosan_client.py HOST PORT AGENT
Prints one JSON object with what the client saw; the pytest test asserts on it.
"""

import json
import sys

from neuro_san.client.concierge_session_factory import ConciergeSessionFactory
from neuro_san.session.grpc_service_agent_session import GrpcServiceAgentSession


def chat(session, text, chat_context=None, filter_type=None, sly_data=None):
    request = {"user_message": {"type": "HUMAN", "text": text}}
    if chat_context is not None:
        request["chat_context"] = chat_context
    if filter_type is not None:
        request["chat_filter"] = {"chat_filter_type": filter_type}
    if sly_data is not None:
        request["sly_data"] = sly_data
    return list(session.streaming_chat(request))


def main() -> None:
    host, port, agent = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # A per-run session, so that the server-side stored context cannot help the client.
    session = GrpcServiceAgentSession(host=host, port=port, agent_name=agent,
                                      metadata={"x-uibus-session": "neurosan-client", "user_id": "tester"})
    out = {"function": session.function({}), "connectivity": session.connectivity({})}
    first = chat(session, "my name is Ada", filter_type="MINIMAL", sly_data={"token": "t0"})
    context = first[-1]["response"]["chat_context"]
    second = chat(session, "what is my name?", chat_context=context, filter_type="MAXIMAL")
    fresh = chat(session, "who am I?", chat_context={}, filter_type="MINIMAL")
    out.update(minimal=first, maximal=second, fresh=fresh)
    concierge = ConciergeSessionFactory().create_session("grpc", hostname=host, port=port)
    out["list"] = concierge.list({})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
