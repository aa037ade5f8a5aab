// Reads the contract off the installed @codebolt/codeboltjs: for every function of every module,
// the frame it sends and the reply it waits for. The result is the table in codeboltjs-table.json
// (tests/test_codeboltjs.py checks the committed table against a fresh run of this script, and the
// uibus gateway against the table).
//
// How each column is found, so that nothing in the table is typed in by hand:
// * `sends`: the library is connected to a recording WebSocket server (the `ws` package it ships
//   with) and each function is called with the arguments in ARGS; the frames that arrive are kept.
// * `waits`: the function's own source names the reply it matches (`response.type === "X"`,
//   `response.event === "X"`, and extra conditions such as `response.agentId === agentId`); each
//   candidate is then proven by calling the function again, answering with that reply only, and
//   seeing the promise (or the returned emitter) settle within SETTLE_MS.
//
// Usage: node extract.js > codeboltjs-table.json
"use strict";
const fs = require("fs");
const os = require("os");
const path = require("path");
const { WebSocketServer } = require("ws");
const { kindOf } = require("./kinds");

const SETTLE_MS = 1000;  // a reply settles a promise at once; silence is waited out this long
const LOCAL_MS = 100;  // how long a call may take to settle by itself (local work)
const FRAME_MS = 500;  // generous: a late frame on a busy machine must not change the table

// The arguments each function is called with. A function of the library missing here is an error:
// a new library version must be read, not guessed.
const ARGS = {
  "fs.createFile": ["a.txt", "hello", "/tmp"],
  "fs.createFolder": ["d", "/tmp"],
  "fs.readFile": ["/tmp/a.txt"],
  "fs.updateFile": ["a.txt", "/tmp", "new"],
  "fs.deleteFile": ["a.txt", "/tmp"],
  "fs.deleteFolder": ["d", "/tmp"],
  "fs.listFile": ["/tmp", false],
  "fs.listCodeDefinitionNames": ["/tmp"],
  "fs.searchFiles": ["/tmp", "x", "*.js"],
  "fs.writeToFile": ["/tmp/a.txt", "x"],
  "git.init": ["/tmp/r"],
  "git.clone": ["https://example.invalid/r.git", "/tmp/r"],
  "git.pull": ["/tmp/r"],
  "git.push": ["/tmp/r"],
  "git.status": ["/tmp/r"],
  "git.add": ["/tmp/r"],
  "git.commit": ["msg"],
  "git.checkout": ["/tmp/r", "main"],
  "git.branch": ["/tmp/r", "dev"],
  "git.logs": ["/tmp/r"],
  "git.diff": ["abc", "/tmp/r"],
  "llm.inference": ["hello", "assistant"],
  "browser.newPage": [],
  "browser.getUrl": [],
  "browser.goToPage": ["https://example.invalid"],
  "browser.screenshot": [],
  "browser.getHTML": [],
  "browser.getMarkdown": [],
  "browser.getPDF": [],
  "browser.pdfToText": [],
  "browser.getContent": [],
  "browser.getSnapShot": [],
  "browser.getBrowserInfo": [],
  "browser.extractText": [],
  "browser.close": [],
  "browser.scroll": ["down", "100"],
  "browser.type": ["e1", "text"],
  "browser.click": ["e1"],
  "browser.enter": [],
  "browser.search": ["e1", "query"],
  "chat.getChatHistory": [],
  "chat.sendMessage": ["hello from the agent", {}],
  "chat.waitforReply": ["your turn"],
  "chat.processStarted": [],
  "chat.stopProcess": [],
  "chat.processFinished": [],
  "chat.sendConfirmationRequest": ["Proceed?", ["Yes", "No"], false],
  "chat.askQuestion": ["Which one?", ["A", "B"], false],
  "chat.sendNotificationEvent": ["note", "debug"],
  "terminal.executeCommand": ["ls", false],
  "terminal.executeCommandRunUntilError": ["ls", false],
  "terminal.sendManualInterrupt": [],
  "terminal.executeCommandWithStream": ["ls", false],
  "codeutils.getJsTree": ["extract.js"],  // parsed by the library itself, once the app answers
  "codeutils.getAllFilesAsMarkDown": [],
  "codeutils.performMatch": [{ name: "m" }, [], []],
  "codeutils.getMatcherList": [],
  "codeutils.matchDetail": ["m"],
  "docutils.pdf_to_text": ["/tmp/a.pdf"],
  "crawler.start": [],
  "crawler.screenshot": [],
  "crawler.goToPage": ["https://example.invalid"],
  "crawler.scroll": ["down"],
  "crawler.click": ["e1"],
  "crawler.type": ["e1", "text"],
  "crawler.enter": [],
  "crawler.crawl": ["query"],
  "search.init": ["bing"],
  "search.search": ["query"],
  "search.get_first_link": ["query"],
  "rag.init": [],
  "rag.add_file": ["a.txt", "/tmp/a.txt"],
  "rag.retrieve_related_knowledge": ["q", "a.txt"],
  "codeparsers.getClassesInFile": ["a.js"],
  "codeparsers.getFunctionsinClass": ["a.js", "C"],
  "codeparsers.getAstTreeInFile": ["a.js", "C"],
  "outputparsers.init": ["x"],
  "outputparsers.parseErrors": ["Error: x"],
  "outputparsers.parseWarnings": ["Warning: x"],
  "project.getProjectSettings": [],
  "project.getProjectPath": [],
  "project.getRepoMap": [{}],
  "project.runProject": [],
  "project.getEditorFileStatus": [],
  "dbmemory.addKnowledge": ["k1", { v: 1 }],
  "dbmemory.getKnowledge": ["k1"],
  "cbstate.getApplicationState": [],
  "cbstate.addToAgentState": ["k1", "v1"],
  "cbstate.getAgentState": [],
  "cbstate.getProjectState": [],
  "cbstate.updateProjectState": ["k1", "v1"],
  "taskplaner.addTask": ["write tests"],
  "taskplaner.getTasks": [],
  "taskplaner.updateTask": ["write more tests"],
  "vectordb.getVector": ["k1"],
  "vectordb.addVectorItem": ["item"],
  "vectordb.queryVectorItem": ["k1"],
  "vectordb.queryVectorItems": [["a", "b"], "/tmp/db"],
  "debug.debug": ["log line", "info"],
  "debug.openDebugBrowser": ["http://localhost", 3000],
  "tokenizer.addToken": ["k1"],
  "tokenizer.getToken": ["k1"],
  "chatSummary.summarizeAll": [],
  "chatSummary.summarize": [[{ role: "user", content: "hi" }], 1],
  "tools.getEnabledToolBoxes": [],
  "tools.getLocalToolBoxes": [],
  "tools.getMentionedToolBoxes": [{ userMessage: "hi", mentionedMCPs: [] }],
  "tools.getAvailableToolBoxes": [],
  "tools.searchAvailableToolBoxes": ["query"],
  "tools.listToolsFromToolBoxes": [["box"]],
  "tools.configureToolBox": ["box", {}],
  "tools.getTools": [[{ toolbox: "box", toolName: "t" }]],
  "tools.executeTool": ["box", "t", {}],
  "agent.findAgent": ["a task"],
  "agent.startAgent": ["agent-1", "a task"],
  "agent.getAgentsList": [],
  "agent.getAgentsDetail": [[]],
};
// Listeners that the library offers, not calls: they send nothing and wait for what the app pushes.
const LISTENERS = new Set(["chat.setRequestHandler", "chat.onActionMessage"]);

function replyConditions(fn) {
  const src = fn.toString();
  const out = [];
  const re = /(?:response|message)\.(type|event)\s*===\s*["']([^"']+)["']((?:\s*&&\s*response\.\w+\s*===\s*\w+)*)/g;
  let m;
  while ((m = re.exec(src)) !== null) {
    const match = {};
    for (const c of m[3].matchAll(/response\.(\w+)\s*===\s*(\w+)/g)) match[c[1]] = c[2];
    out.push({ key: m[1], value: m[2], match });
  }
  return out;
}

async function main() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "cbjs-extract-"));
  fs.writeFileSync(path.join(dir, "codeboltagent.yaml"), "unique_connectionid: extract\n");
  const server = new WebSocketServer({ host: "127.0.0.1", port: 0 });
  await new Promise((r) => server.on("listening", r));
  let socket = null;
  let frames = [];
  const connected = new Promise((r) => server.on("connection", (ws) => {
    socket = ws;
    ws.on("message", (data) => frames.push(JSON.parse(data.toString())));
    r();
  }));
  process.env.SOCKET_PORT = String(server.address().port);
  const cwd = process.cwd();
  process.chdir(dir);
  const codebolt = require(path.join(cwd, "node_modules/@codebolt/codeboltjs")).default;
  process.chdir(cwd);
  await connected;
  await codebolt.waitForConnection();

  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  // Resolves once a frame arrived (then a little more, for a second one), or after FRAME_MS.
  const framesIn = async () => {
    for (let t = 0; t < FRAME_MS && frames.length === 0; t += 5) await sleep(5);
    await sleep(10);
  };
  const settles = (value, kind, reply, ms = SETTLE_MS) => new Promise((resolve) => {
    const timer = setTimeout(() => resolve(false), ms);
    const done = () => { clearTimeout(timer); resolve(true); };
    if (kind === "promise") value.then(done, done);
    else if (kind === "emitter") value.once(reply.value, done);
    else resolve(false);
  });

  const table = [];
  const unknown = [];
  for (const [module, obj] of Object.entries(codebolt)) {
    if (!obj || typeof obj !== "object" || module === "websocket") continue;
    for (const [name, fn] of Object.entries(obj)) {
      if (typeof fn !== "function") continue;
      const call = `${module}.${name}`;
      if (LISTENERS.has(call)) {
        table.push({ call, kind: "listener", sends: [], waits: replyConditions(fn) });
        continue;
      }
      if (!(call in ARGS)) { unknown.push(call); continue; }
      frames = [];
      let value;
      try { value = fn.apply(obj, ARGS[call]); } catch (err) { value = undefined; }
      const kind = kindOf(value);
      if (kind === "promise") value.catch(() => {});
      await framesIn();
      const sends = frames;
      const waits = replyConditions(fn);
      const row = { call, args: ARGS[call], kind, sends, waits };
      if (kind === "promise" || kind === "emitter") {
        // A promise that settles with no reply at all is local work (or no work).
        row.local = await settles(value, kind, { value: "" }, LOCAL_MS);
        for (const w of waits) {
          frames = [];
          const again = fn.apply(obj, ARGS[call]);
          if (kindOf(again) === "promise") again.catch(() => {});
          await framesIn();
          const reply = { [w.key]: w.value, success: false };
          const sent = frames[0] || {};
          for (const [field, arg] of Object.entries(w.match)) reply[field] = sent[field] !== undefined ? sent[field] : arg;
          socket.send(JSON.stringify(reply));
          w.settles = await settles(again, kindOf(again), w);
        }
      }
      table.push(row);
    }
  }
  if (unknown.length) {
    console.error(`functions with no arguments in ARGS (read them and add them): ${unknown.join(", ")}`);
    process.exit(2);
  }
  process.stdout.write(JSON.stringify({ library: "@codebolt/codeboltjs",
    version: require(path.join(cwd, "node_modules/@codebolt/codeboltjs/package.json")).version, calls: table }, null, 1) + "\n");
  process.exit(0);
}

main().catch((err) => { console.error(err); process.exit(1); });
