// Extension-UI side of the page: answers select/confirm/input/editor dialogs and shows the
// fire-and-forget requests (notify, status, widgets, title, editor text) of the session.
import { Code, ConnectError } from "@connectrpc/connect";
import type { Client } from "@connectrpc/connect";
import { DialogOutcome, ExtensionUiService, NotifyType } from "./gen/uibus/v1/extension_ui_pb";
import type { ExtensionUiEvent, ExtensionUiRequest, RespondRequest } from "./gen/uibus/v1/extension_ui_pb";

type Ui = {
  dialogs: HTMLElement;
  statuses: HTMLElement;
  widgets: HTMLElement;
  title: HTMLElement;
  input: HTMLTextAreaElement;
  log: (label: string, detail?: string) => void;
};

const OUTCOME: Record<number, string> = {
  [DialogOutcome.ANSWERED]: "answered",
  [DialogOutcome.CANCELLED]: "cancelled",
  [DialogOutcome.TIMED_OUT]: "timed out",
  [DialogOutcome.CALLER_CANCELLED]: "withdrawn by the agent",
  [DialogOutcome.SHUTDOWN]: "server shutting down",
};

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls = "", text = ""): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

export type ExtensionUi = {
  // One event of the session's extension UI, as the page's one stream carries it (main.ts).
  event: (ev: ExtensionUiEvent) => void;
  // Forget what is shown (another session, a stream that starts from the snapshot, a gap): the
  // snapshot that follows brings back the title, statuses, widgets and every dialog still waiting.
  reset: () => void;
};

// The session's extension UI: its events come over the page's one stream (WebviewService, with
// `extension_ui`); answers go back as unary `Respond` calls.
export function extensionUi(client: Client<typeof ExtensionUiService>, ui: Ui): ExtensionUi {
  const open = new Map<string, HTMLElement>();

  async function respond(id: string, answer: RespondRequest["answer"], card: HTMLElement): Promise<void> {
    card.querySelectorAll("button, input, textarea").forEach((b) => ((b as HTMLButtonElement).disabled = true));
    try {
      await client.respond({ id, answer });
    } catch (err) {
      const e = ConnectError.from(err);
      // Another UI answered first, or the dialog is gone: the `closed` event removes the card.
      if (e.code !== Code.FailedPrecondition && e.code !== Code.NotFound) ui.log("answer failed", e.rawMessage);
    }
  }

  function dialog(req: ExtensionUiRequest): void {
    if (open.has(req.id)) return;
    const card = el("section", "dialog");
    card.dataset.dialog = req.id;
    card.dataset.kind = req.method.case ?? "";
    card.dataset.addressee = (req.method.value as { addressee?: string } | undefined)?.addressee ?? ""; // roles.ts
    const buttons = el("div", "buttons");
    // `answer` is read when clicked, so input/editor send the field's text at that moment.
    const button = (label: string, answer: () => RespondRequest["answer"], primary = false) => {
      const b = el("button", primary ? "" : "secondary", label);
      b.type = "button";
      b.addEventListener("click", () => void respond(req.id, answer(), card));
      buttons.append(b);
    };
    const cancel = () => button("Cancel", () => ({ case: "cancelled", value: true }));
    const m = req.method;
    if (m.case === "select") {
      card.append(el("h3", "", m.value.title));
      for (const option of m.value.options) button(option, () => ({ case: "value", value: option }), true);
      cancel();
    } else if (m.case === "confirm") {
      card.append(el("h3", "", m.value.title));
      if (m.value.message) card.append(el("p", "", m.value.message));
      button("Yes", () => ({ case: "confirmed", value: true }), true);
      button("No", () => ({ case: "confirmed", value: false }));
      cancel();
    } else if (m.case === "input" || m.case === "editor") {
      card.append(el("h3", "", m.value.title));
      const field = m.case === "input" ? el("input") : el("textarea");
      if (m.case === "input") field.placeholder = m.value.placeholder ?? "";
      else field.value = m.value.prefill ?? "";
      card.append(field);
      button(m.case === "input" ? "OK" : "Save", () => ({ case: "value", value: field.value }), true);
      if (field instanceof HTMLInputElement) {
        field.addEventListener("keydown", (ev) => {
          if (ev.key === "Enter") void respond(req.id, { case: "value", value: field.value }, card);
        });
      }
      cancel();
    } else {
      return;
    }
    if (req.expiresAtMs > 0n) {
      const left = el("small", "expires");
      const tick = () => {
        const s = Math.max(0, Math.ceil((Number(req.expiresAtMs) - Date.now()) / 1000));
        left.textContent = `closes in ${s}s`;
        if (open.has(req.id) && s > 0) setTimeout(tick, 500);
      };
      card.append(left);
      tick();
    }
    card.append(buttons);
    open.set(req.id, card);
    ui.dialogs.append(card);
    (card.querySelector("input, textarea, button") as HTMLElement | null)?.focus();
  }

  function request(req: ExtensionUiRequest): void {
    const m = req.method;
    switch (m.case) {
      case "select": case "confirm": case "input": case "editor":
        dialog(req);
        break;
      case "notify": {
        const kind = m.value.notifyType === NotifyType.ERROR ? "error"
          : m.value.notifyType === NotifyType.WARNING ? "warning" : "info";
        ui.log(`notify · ${kind}`, m.value.message);
        const toast = el("div", `toast ${kind}`, m.value.message);
        document.body.append(toast);
        setTimeout(() => toast.remove(), 5000);
        break;
      }
      case "setStatus": {
        let pill = ui.statuses.querySelector<HTMLElement>(`[data-key="${CSS.escape(m.value.key)}"]`);
        if (m.value.text === undefined) { pill?.remove(); break; }
        if (!pill) { pill = el("span", "pill status-entry"); pill.dataset.key = m.value.key; ui.statuses.append(pill); }
        pill.textContent = m.value.text;
        break;
      }
      case "setWidget": {
        let w = ui.widgets.querySelector<HTMLElement>(`[data-key="${CSS.escape(m.value.key)}"]`);
        if (!m.value.lines.length) { w?.remove(); break; }
        if (!w) { w = el("pre", "widget"); w.dataset.key = m.value.key; ui.widgets.append(w); }
        w.textContent = m.value.lines.join("\n");
        break;
      }
      case "setTitle":
        ui.title.textContent = m.value.title;
        ui.title.hidden = !m.value.title;
        break;
      case "setEditorText":
        ui.input.value = m.value.text;
        ui.log("editor text set");
        break;
    }
  }

  function event(ev: ExtensionUiEvent): void {
    if (ev.gap) { // the log no longer reaches back to this page's cursor: the snapshot follows
      reset();
      ui.log("gap", "extension UI: starting over from the session's state");
    }
    if (ev.event.case === "request") request(ev.event.value);
    else if (ev.event.case === "closed") {
      const { id, reason } = ev.event.value;
      open.get(id)?.remove();
      if (open.delete(id)) ui.log("dialog closed", OUTCOME[reason] ?? "");
    }
  }

  function reset(): void {
    for (const card of open.values()) card.remove();
    open.clear();
    ui.statuses.replaceChildren();
    ui.widgets.replaceChildren();
    ui.title.textContent = "";
    ui.title.hidden = true;
  }

  return { event, reset };
}
