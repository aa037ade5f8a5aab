// The MCP TypeScript SDK's v2 client (@modelcontextprotocol/client, unmodified) against uibus's /mcp:
// argv: <url> <uibus session> <mode: auto|legacy>. With "auto" it probes server/discover and speaks
// 2026-07-28; it lists the tools, calls an agent, and answers ask_user through input_required (its
// elicitation handler fills in the form, the SDK retries with the answer). Prints one JSON line.
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";

const [url, session, mode] = process.argv.slice(2);
const transport = new StreamableHTTPClientTransport(new URL(url), {
  requestInit: { headers: { "x-uibus-session": session } },
});
const client = new Client({ name: "uibus-test-ts", version: "1.0.0" }, {
  capabilities: { elicitation: { form: {} } },
  versionNegotiation: { mode },
});
const forms = [];
client.setRequestHandler("elicitation/create", async (request) => {
  forms.push(request.params);
  return { action: "accept", content: { value: "later" } };
});
await client.connect(transport);
const out = { version: client.getNegotiatedProtocolVersion(), server: client.getServerVersion()?.name };
out.tools = (await client.listTools()).tools.map((t) => t.name);
const chat = await client.callTool({ name: "hello_world", arguments: { user_message: { type: "HUMAN", text: "hi from ts" } } });
out.chat = chat.content[0].text;
if (out.version === "2026-07-28") {  // today's era asks the person at the session's UIs instead
  const asked = await client.callTool({ name: "ask_user", arguments: { title: "Deploy now?", options: ["yes", "later"] } });
  out.asked = { text: asked.content[0].text, structured: asked.structuredContent };
}
out.forms = forms;
await client.close();
console.log(JSON.stringify(out));
