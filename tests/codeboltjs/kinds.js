// What a codeboltjs function returned, as the table names it (shared by extract.js and drive.js).
"use strict";

function kindOf(value) {
  if (value && typeof value.then === "function") return "promise";
  if (value && typeof value.on === "function" && typeof value.emit === "function") return "emitter";
  // chat.processStarted: {event: EventEmitter, stopProcess}
  if (value && typeof value === "object" && value.event && typeof value.event.on === "function") return "process";
  return value === undefined ? "none" : typeof value;
}

module.exports = { kindOf };
