// A pi extension for tests/test_pi_slash.py: it does some work when a run starts (as an extension
// that loads context might), so pi tells its RPC client `agent_start` a little after it answered
// the prompt — the order in which a client that ends a turn at the prompt's response loses the run.
export default function (pi: any) {
  pi.on("agent_start", async () => {
    await new Promise((resolve) => setTimeout(resolve, 400));
  });
}
