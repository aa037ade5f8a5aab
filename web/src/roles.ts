// Roles on the page (docs/security/roles.md): what a person may not do is not offered. The page asks
// TeamService/WhoAmI for the open session (again when it switches, and every few seconds: a role
// changed by an owner shows without a reload) and marks <body> with what the role allows; CSS hides
// the rest: an observer sees no input box, no answer buttons and no stop/mode/model; a participant
// sees no answer buttons unless the dialog is addressed to them (each dialog card carries its
// addressee, extui.ts). The server refuses what is not allowed anyway; this only stops offering it.
// An invite link (`/invite/<token>`, which lands here as `#invite=<token>`) is accepted once signed in.
import { ConnectError } from "@connectrpc/connect";
import type { Client } from "@connectrpc/connect";
import { TeamService } from "./gen/uibus/v1/team_pb";

const RANK: Record<string, number> = { observer: 0, participant: 1, approver: 2, owner: 3 };
const DEFAULT_ADDRESSEE: Record<string, string> = { select: "approver", confirm: "approver", input: "participant",
  editor: "participant" };
const REFRESH_MS = 5000;

export const atLeast = (held: string, least: string): boolean =>
  held in RANK && least in RANK && RANK[held] >= RANK[least];

const STYLE = `
body[data-may-chat="no"] #chat, body[data-may-steer="no"] #stop, body[data-may-steer="no"] #mode,
body[data-may-steer="no"] #model, body[data-may-chat="no"] #new-session { display: none !important; }
#dialogs .dialog[data-answerable="no"] .buttons, #dialogs .dialog[data-answerable="no"] input,
#dialogs .dialog[data-answerable="no"] textarea { display: none !important; }
#dialogs .dialog[data-answerable="no"]::after { content: "waiting for " attr(data-addressee); font-size: .85em; opacity: .7; }
`;

type Roles = {
  team: Client<typeof TeamService>;
  current: () => string;
  log: (label: string, detail?: string) => void;
  dialogs: HTMLElement;
};

export function startRoles(r: Roles): { sessionChanged: () => void } {
  const style = document.createElement("style");
  style.textContent = STYLE;
  document.head.append(style);
  let role = "";
  let person = "";
  let asked = 0;

  // A dialog card is answerable by this person: addressed to them, or to a role they hold.
  function mark(card: HTMLElement): void {
    const to = card.dataset.addressee || DEFAULT_ADDRESSEE[card.dataset.kind ?? ""] || "approver";
    const mine = to.startsWith("person:") ? to.slice(7) === person && person !== "" : atLeast(role, to);
    card.dataset.answerable = mine ? "yes" : "no";
  }
  const markAll = () => r.dialogs.querySelectorAll<HTMLElement>(".dialog").forEach(mark);
  new MutationObserver(markAll).observe(r.dialogs, { childList: true });

  async function refresh(): Promise<void> {
    const mine = ++asked;
    const session = r.current();
    try {
      const who = await r.team.whoAmI({}, { headers: { "x-uibus-session": session } });
      if (mine !== asked || session !== r.current()) return; // a newer answer is on its way
      role = who.role;
      person = who.person;
    } catch (err) {
      if (mine !== asked) return;
      const e = ConnectError.from(err);
      if (e.code === 12 /* Unimplemented: a server without roles */) role = "owner";
      else return; // offline: keep what was known
    }
    const b = document.body.dataset;
    b.role = role || "none";
    b.mayChat = atLeast(role, "participant") ? "yes" : "no";
    b.mayAnswer = atLeast(role, "approver") ? "yes" : "no";
    b.maySteer = atLeast(role, "owner") ? "yes" : "no";
    markAll();
  }

  async function acceptInvite(): Promise<void> {
    const fragment = new URLSearchParams(location.hash.slice(1));
    const invite = fragment.get("invite");
    if (!invite) return;
    fragment.delete("invite");
    const rest = fragment.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
    try {
      const got = await r.team.acceptInvite({ token: invite });
      r.log("invite accepted", `${got.session} as ${got.role}`);
      if (got.session !== r.current()) { // a fresh load of that session (the page's streams start over)
        const url = new URL(location.href);
        url.searchParams.set("session", got.session);
        location.replace(url);
      }
    } catch (err) {
      r.log("invite refused", ConnectError.from(err).rawMessage);
    }
  }

  void acceptInvite().then(refresh);
  setInterval(() => void refresh(), REFRESH_MS);
  return { sessionChanged: () => void refresh() };
}
