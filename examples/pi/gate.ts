// A permission gate for the pi agent behind uibus (examples/pi-agent.toml loads it with -e): a bash
// command with `rm -rf` waits until someone at a UI of the session allows it (every UI shows it).
export default function (pi: any) {
  pi.on("tool_call", async (event: any, ctx: any) => {
    if (event.toolName !== "bash") return undefined;
    const command = String(event.input.command ?? "");
    if (!/\brm\s+-rf\b/.test(command)) return undefined;
    const choice = await ctx.ui.select(`Dangerous command: ${command}`, ["Allow", "Block"]);
    return choice === "Allow" ? undefined : { block: true, reason: "Blocked by user" };
  });
}
