// The MCP TypeScript SDK's own client (@modelcontextprotocol/sdk, pinned by package-lock.json) calling
// a tool on uibus's /mcp and resuming its event stream as the SDK documents it: the resumption
// token each event gives (`onresumptiontoken`), handed to a new transport of the same session
// (`resumptionToken`), which reconnects with GET and Last-Event-ID. For tests/test_stream_resume.py.
//
//   node mcp-resume.mjs call <url> <headers-json> <tool> <args-json>
//   node mcp-resume.mjs resume <url> <headers-json> <tool> <args-json> <session-id> <token> <request-id>
//
// Prints JSON lines: {"ev":"session","id":S}, {"ev":"token","token":T}, {"ev":"progress","progress":N,
// "message":M}, then {"ev":"result","result":R} or {"ev":"error","message":E}. `resume` first sends
// pings until its next request id is <request-id> (the SDK's progress token is the request id, and
// the replayed progress notifications carry the original one), then asks for the call's stream.
// MCP_RETRIES=n lets the transport reconnect by itself (GET + Last-Event-ID) when its stream breaks.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { CallToolResultSchema } from "@modelcontextprotocol/sdk/types.js";

const emit = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const [mode, url, headers, tool, args, sessionId, token, requestId] = process.argv.slice(2);

const transport = new StreamableHTTPClientTransport(new URL(url), {
  requestInit: { headers: JSON.parse(headers) },
  sessionId: mode === "resume" ? sessionId : undefined,
  reconnectionOptions: { initialReconnectionDelay: 300, maxReconnectionDelay: 1000, reconnectionDelayGrowFactor: 1.5,
                         maxRetries: Number(process.env.MCP_RETRIES ?? 0) },
});
const client = new Client({ name: "uibus-resume-test", version: "1.0.0" });
client.onerror = (e) => emit({ ev: "transport_error", message: String(e && e.message) });
await client.connect(transport);
emit({ ev: "session", id: transport.sessionId });

const options = {
  onprogress: (p) => emit({ ev: "progress", progress: p.progress, message: p.message }),
  onresumptiontoken: (t) => emit({ ev: "token", token: t }),
  timeout: 60000,
};
const request = { method: "tools/call", params: { name: tool, arguments: JSON.parse(args) } };
try {
  if (mode === "resume") {
    for (let i = 0; i < Number(requestId); i++) await client.ping();
    options.resumptionToken = token;
  }
  const result = await client.request(request, CallToolResultSchema, options);
  emit({ ev: "result", result });
} catch (e) {
  emit({ ev: "error", message: String(e && e.message) });
}
await transport.close();
process.exit(0);
