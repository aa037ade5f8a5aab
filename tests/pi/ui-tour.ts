// A pi extension for tests/test_pi_rpc.py: one command that calls every extension-UI method of
// pi's RPC mode and reports what each dialog returned (as a last notify), so a test can check both
// directions of the protocol that uibus will bridge to its dialogs.
export default function (pi: any) {
  pi.registerCommand("ui-tour", {
    description: "every extension-UI method, in order",
    handler: async (_args: string, ctx: any) => {
      const picked = await ctx.ui.select("Allow dangerous command?", ["Allow", "Block"], { timeout: 10000 });
      const confirmed = await ctx.ui.confirm("Clear session?", "All messages will be lost.", { timeout: 400 });
      const typed = await ctx.ui.input("Enter a value", "type something...");
      const edited = await ctx.ui.editor("Edit some text", "Line 1\nLine 2");
      ctx.ui.notify("Command blocked by user", "warning");
      ctx.ui.setStatus("my-ext", "Turn 3 running...");
      ctx.ui.setStatus("my-ext", undefined);
      ctx.ui.setWidget("my-ext", ["--- My Widget ---", "Line 1"], { placement: "belowEditor" });
      ctx.ui.setTitle("atomic - my project");
      ctx.ui.setEditorText("prefilled text for the user");
      ctx.ui.notify(JSON.stringify({ picked, confirmed, typed, edited: edited ?? null }), "info");
    },
  });
}
