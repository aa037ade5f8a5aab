"""The webview page served by `GET /` and `UiService.getWebviewHtml`.

The built page ships as package data in server/static/ (see web/README for how it is built);
until it has been built, a small self-contained page still gives a browser something true.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

_FALLBACK = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>uibus</title></head>
<body><h1>uibus</h1><p>The webview bundle is not built in this install.</p></body></html>
"""


@cache
def webview_html() -> str:
    page = resources.files("uibus").joinpath("static/index.html")
    return page.read_text(encoding="utf-8") if page.is_file() else _FALLBACK


# With tokens configured, `GET /` without a token answers 401 with this page. A browser cannot
# send a header when it navigates, so the page takes the token from the URL fragment
# (`/#token=T`, never sent to any server and removed from the address bar at once) or from the
# form, keeps it for the tab (sessionStorage), fetches the real page with it and replaces itself
# with that page, which sends the same token on every call.
_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>uibus · token</title>
<style>
  body { margin: 0; height: 100vh; display: grid; place-items: center; background: #1e1f24; color: #e3e5ea;
         font: 14px/1.45 system-ui, -apple-system, sans-serif; color-scheme: dark; }
  form { display: flex; gap: .5em; } input, button { font: inherit; padding: .4em .6em; }
</style></head>
<body><main>
<h1>uibus</h1>
<p id="why">This server needs a token. Paste it here, or open this page as <code>/#token=…</code>.</p>
<!-- SIGNIN -->
<form id="login"><input id="token" type="password" autocomplete="current-password" aria-label="token"
  placeholder="token" required><button type="submit">Open</button></form>
</main>
<script>
"use strict";
(() => {
  const KEY = "uibus-token";
  const why = document.getElementById("why");
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.has("token")) {
    sessionStorage.setItem(KEY, hash.get("token"));
    hash.delete("token");
    const rest = hash.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
  }
  async function open(token) {
    const reply = await fetch(location.pathname + location.search,
                              { headers: { authorization: "Bearer " + token }, cache: "no-store" });
    if (reply.status !== 200) {
      sessionStorage.removeItem(KEY);
      why.textContent = reply.status === 401 ? "That token was refused." : "The server answered " + reply.status + ".";
      return;
    }
    sessionStorage.setItem(KEY, token);
    const page = await reply.text();
    document.open();
    document.write(page);
    document.close();
  }
  document.getElementById("login").addEventListener("submit", (event) => {
    event.preventDefault();
    open(document.getElementById("token").value.trim());
  });
  const saved = sessionStorage.getItem(KEY);
  if (saved) open(saved);
})();
</script>
</body></html>
"""


# With --oidc-issuer, people sign in through the provider (uibus.edge.transports.signin); the token
# form stays for machines' tokens. `notice` says why a sign-in cookie no longer counts (expired,
# signed out elsewhere), so a person whose session ended is told, not just asked again.
_SIGNIN = """<p id="signin-notice" role="alert">{notice}</p>
<p><a id="signin" class="signin" href="/auth/login">Sign in</a> with your organisation's account</p>
<script>
"use strict";
document.getElementById("signin").href = "/auth/login?return=" +
  encodeURIComponent(location.pathname + location.search);
if (!document.getElementById("signin-notice").textContent) document.getElementById("signin-notice").hidden = true;
</script>
"""


def login_html(*, signin: bool = False, notice: str = "") -> str:
    """The page `GET /` answers (401) to a browser without a token when tokens are configured;
    `signin`: with the link to sign in through the provider, and `notice` why a sign-in ended."""
    if not signin:
        return _LOGIN
    safe = notice.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _LOGIN.replace("<!-- SIGNIN -->", _SIGNIN.replace("{notice}", safe[:300]))
