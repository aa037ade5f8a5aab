// The page's sign-in through the team's identity provider (docs/security/sign-in.md, "The page").
//
// The server keeps the sign-in in an HttpOnly cookie the page cannot read; what the page reads is
// the companion cookie `uibus_csrf` (`__Host-uibus_csrf` under TLS), whose value every call echoes
// as `x-uibus-csrf`: a cross-site page can make the browser send the cookie, never read it, so it
// cannot send this header. A page opened with a token (`#token=T`) uses the token and none of this.
import { Code, ConnectError } from "@connectrpc/connect";

export interface SignedIn {
  person: string;
  tenant: string;
  role: string;
  exp: number; // epoch seconds
  name: string;
  csrf: string;
}

function cookie(name: string): string {
  for (const part of document.cookie.split(";")) {
    const [key, ...rest] = part.trim().split("=");
    if (key === name) return rest.join("=");
  }
  return "";
}

// The session's CSRF value, "" when this page is not signed in with a cookie.
export function csrfValue(): string {
  return cookie("__Host-uibus_csrf") || cookie("uibus_csrf");
}

let lost = false;

// Shown when the sign-in has ended (expired, or signed out in another tab): what happened, and the
// way back, in place of a page whose every call would now be refused.
export function signinEnded(why: string): void {
  if (lost) return;
  lost = true;
  const box = document.createElement("div");
  box.id = "signin-ended";
  box.setAttribute("role", "alertdialog");
  box.style.cssText = "position:fixed;inset:0;display:grid;place-items:center;background:rgba(0,0,0,.7);z-index:99";
  const inner = document.createElement("div");
  inner.style.cssText = "background:var(--panel,#26272d);padding:1.5em;border-radius:8px;max-width:28em";
  const text = document.createElement("p");
  text.id = "signin-ended-why";
  text.textContent = why;
  const again = document.createElement("a");
  again.id = "sign-in-again";
  again.textContent = "Sign in again";
  again.href = `/auth/login?return=${encodeURIComponent(location.pathname + location.search)}`;
  inner.append(text, again);
  box.append(inner);
  document.body.append(box);
}

// A call's outcome, watched: an Unauthenticated answer to a cookie-signed call means the sign-in
// ended (its cookie expired or was signed out): say so instead of failing quietly.
export async function watched<T>(call: Promise<T>): Promise<T> {
  try {
    return await call;
  } catch (e) {
    if (e instanceof ConnectError && e.code === Code.Unauthenticated && csrfValue() === "") {
      signinEnded("Your sign-in session has ended. Sign in again to continue.");
    } else if (e instanceof ConnectError && e.code === Code.Unauthenticated) {
      signinEnded(`Your sign-in session was refused: ${e.rawMessage}`);
    }
    throw e;
  }
}

// Who is signed in, shown in the header with "Sign out"; a timer at the session's expiry says it
// has ended. Nothing happens for a page opened with a token or on a server without sign-in.
export async function startSignin(token: string, server: string): Promise<SignedIn | null> {
  if (token || !csrfValue()) return null;
  const reply = await fetch(`${server}/auth/me`, { credentials: "include", cache: "no-store" });
  if (!reply.ok) {
    signinEnded("Your sign-in session has ended. Sign in again to continue.");
    return null;
  }
  const me = (await reply.json()) as SignedIn;
  const who = document.createElement("span");
  who.id = "signed-in";
  who.className = "pill";
  who.dataset.person = me.person;
  who.dataset.tenant = me.tenant;
  who.dataset.role = me.role;
  who.title = `signed in until ${new Date(me.exp * 1000).toLocaleTimeString()}`;
  who.textContent = `${me.name || me.person} · ${me.tenant} · ${me.role || "member"}`;
  const form = document.createElement("form");
  form.method = "post";
  form.action = `${server}/auth/logout`;
  form.style.display = "inline";
  const csrf = document.createElement("input");
  csrf.type = "hidden";
  csrf.name = "csrf";
  csrf.value = me.csrf;
  const out = document.createElement("button");
  out.type = "submit";
  out.id = "sign-out";
  out.className = "secondary";
  out.textContent = "Sign out";
  form.append(csrf, out);
  const status = document.getElementById("status");
  status?.before(who, form);
  const left = me.exp * 1000 - Date.now();
  const end = () => signinEnded(`Your sign-in session expired at ${new Date(me.exp * 1000).toLocaleTimeString()}. `
    + "Sign in again to continue.");
  if (left <= 0) end();
  else setTimeout(end, Math.min(left, 2 ** 31 - 1));
  return me;
}
