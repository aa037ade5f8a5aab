"""Counts and lists in the prose (README.md, docs/**) said against the code that defines them: the
protos' RPCs, the MCP tools, the roles, the quotas, the layers. README.md once said "all 16 RPCs" of
a UiService that had 22; each such number is now a claim here, checked against the descriptors or
the registry, and a sweep fails on any count of RPCs, methods, tools, quotas, roles, layers… that no
claim covers, so a new one cannot go stale unnoticed either. (docs/reference/ is generated from the
code: tests/docs_gen.py.)"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO
from tests.test_architecture import LAYERS
from uibus.edge.mcp.session_tools import SESSION_TOOLS
from uibus.edge.mcp.user_tools import USER_TOOLS
from uibus.edge.metrics import MAX_METHOD_LABELS
from uibus.infra.quotas import QUOTAS
from uibus.infra.roles import ROLES
from uibus.pb.cline import ui_pb2

WORDS = {w: n for n, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                    "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
NUMBER = r"(?:\d[\d,]*|" + "|".join(sorted(WORDS, key=len, reverse=True)) + ")"
# What a count in the prose may count that the code defines. "one" is left out: "one tool each", "one
# route table" say "a single", not a tally.
COUNTED = r"(?:RPCs?|methods?|services?|tools?|quotas?|flags?|options?|roles?|layers?|folders?|asks?|subcommands?)"
SWEEP = re.compile(rf"\b(?!one\b){NUMBER}\s+(?:[\w`'-]+\s+){{0,2}}?{COUNTED}\b", re.IGNORECASE)

UI_SERVICE = ui_pb2.DESCRIPTOR.services_by_name["UiService"]
UI_RPCS = [m.name for m in UI_SERVICE.methods]
SERVER_FOLDERS = sorted(p.name for p in (REPO / "server").iterdir()
                        if p.is_dir() and p.name not in ("pb", "static", "__pycache__"))


def number(word: str) -> int:
    return WORDS[word.lower()] if word.lower() in WORDS else int(word.replace(",", ""))


@dataclass(frozen=True)
class Claim:
    """A count in a page: `pattern`'s groups are numbers; `check` gets them and the page's text and
    returns what is wrong ("" when it holds)."""
    path: str
    pattern: str
    check: Callable[[list[int], str], str]


def _equal(what: str, truth: Callable[[], int]) -> Callable[[list[int], str], str]:
    def check(found: list[int], _: str) -> str:
        return "" if found == [truth()] else f"says {found[0]} {what}, the code has {truth()}"
    return check


def _cline_today(found: list[int], text: str) -> str:
    """"Besides the 16 RPCs of the revision uibus started from, … the six a current Cline webview
    calls" followed by a table naming those six: the two add up to UiService's, and the table names
    exactly as many RPCs, each one of UiService's."""
    old, new = found
    table = text[text.index("## Today's Cline webview"):]
    table = table[table.index("|---|"):].split("\n\n")[0]
    named = [n for row in table.splitlines()[1:] for n in re.findall(r"`(\w+)[`(]", row.split("|")[1])]
    wrong = [n for n in named if n not in UI_RPCS]
    if old + new != len(UI_RPCS) or len(named) != new or wrong:
        return (f"{old} + {new} RPCs, UiService has {len(UI_RPCS)}; the table names {len(named)} "
                f"({', '.join(named)}), not in UiService: {wrong}")
    return ""


def _newer_asks(found: list[int], text: str) -> str:
    listed = re.findall(r"`(\w+) = (\d+)`", text[text.index("newer asks are"):].split("here.")[0])
    values = {name: ui_pb2.ClineAsk.Value(name) for name, _ in listed if name in ui_pb2.ClineAsk.keys()}
    wrong = [f"{name} = {n} (the proto: {values.get(name)})" for name, n in listed if values.get(name) != int(n)]
    return "" if found == [len(listed)] and not wrong else f"says {found[0]}, lists {listed}; wrong: {wrong}"


def _roles(found: list[int], text: str) -> str:
    table = re.findall(r"^\| `(\w+)` \|", text.split("## ")[0], re.MULTILINE)
    return "" if found == [len(ROLES)] and tuple(table) == ROLES else \
        f"says {found[0]} roles, its table {table}; uibus.infra.roles.ROLES is {ROLES}"


def _folders(found: list[int], text: str) -> str:
    block = text[text.index("```\n") + 4:]
    listed = re.findall(r"^(\w+)/ ", block[:block.index("```")], re.MULTILINE)
    if found != [len(SERVER_FOLDERS), len(LAYERS)] or sorted(listed) != SERVER_FOLDERS:
        return (f"says {found[0]} folders and {found[1]} layers, lists {listed}; server/ has {SERVER_FOLDERS}, "
                f"tests/test_architecture.py {len(LAYERS)} layers")
    return ""


def _user_tools(found: list[int], text: str) -> str:
    tools = sorted({*USER_TOOLS, *SESSION_TOOLS})
    missing = [t for t in tools if f"**`{t}`**" not in text]
    return f"the tool list lacks {missing}" if missing else ""


def _quotas(found: list[int], text: str) -> str:
    """The quota table's rows are uibus.infra.quotas.QUOTAS, each flag with its default."""
    table = text[text.index("## The quotas"):].split("\n\n")[1]
    rows = dict(re.findall(r"^\| `--quota-([\w-]+)` \| `\w+` \| `(\d+)` \|", table, re.MULTILINE))
    code = {name.replace("_", "-"): str(q.default) for name, q in QUOTAS.items()}
    return "" if rows == code else f"the table has {rows}, uibus.infra.quotas.QUOTAS {code}"


CLAIMS = [
    *(Claim(path, r"all (\w+) RPCs of Cline's", _equal("UiService RPCs", lambda: len(UI_RPCS)))
      for path in ("README.md", "docs/index.md", "docs/protocols/cline.md")),
    Claim("docs/protocols/cline.md", r"Besides the (\w+) RPCs of the revision uibus started from, uibus serves "
                                     r"the (\w+) a current Cline webview\s+calls", _cline_today),
    Claim("docs/protocols/cline.md", r"so the (\w+) newer asks", _newer_asks),
    Claim("docs/security/roles.md", r"one of (\w+) roles", _roles),
    Claim("docs/architecture.md", r"The server is (\w+) folders and (\w+) layers", _folders),
    Claim("docs/behaviour.md", r"past ([\d,]+) distinct methods", _equal("method labels", lambda: MAX_METHOD_LABELS)),
    # Lists, no number: every MCP tool uibus serves is in the page's list of its tools.
    Claim("docs/protocols/mcp.md", r"and its tools are()", lambda _, text: _user_tools([], text)),
    Claim("docs/security/quotas.md", r"## The quotas()", _quotas),
]

# Counts the sweep finds that count nothing the code defines, each with why.
NOT_COUNTS = {
    ("docs/security.md", "405 names the methods"): "an HTTP status, not a count",
}


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "reference" not in p.parts[-2:-1])]


def test_every_claim_holds() -> None:
    """Each registered count says what the code has."""
    wrong = []
    for claim in CLAIMS:
        text = (REPO / claim.path).read_text()
        m = re.search(claim.pattern, text)
        if m is None:
            wrong.append(f"{claim.path}: no longer says {claim.pattern!r} (reword its claim in this file)")
            continue
        problem = claim.check([number(g) for g in m.groups() if g], text)
        if problem:
            wrong.append(f"{claim.path}: {problem}")
    assert not wrong, "counts in the docs that disagree with the code:\n" + "\n".join(wrong)


def test_every_count_is_a_claim() -> None:
    """Any count of RPCs, methods, tools, quotas, roles, layers… in README.md or docs/ is one of CLAIMS
    (checked against the code) or NOT_COUNTS (with why): a new "all 16 RPCs" cannot go unchecked."""
    covered: dict[str, list[tuple[int, int]]] = {}
    for claim in CLAIMS:
        text = (REPO / claim.path).read_text()
        covered.setdefault(claim.path, []).extend(m.span() for m in re.finditer(claim.pattern, text))
    loose = []
    for page in _pages():
        rel = str(page.relative_to(REPO))
        text = page.read_text()
        for m in SWEEP.finditer(text):
            phrase = " ".join(m.group(0).split())
            if (rel, phrase) in NOT_COUNTS or any(a <= m.start() < b for a, b in covered.get(rel, [])):
                continue
            loose.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {phrase!r}")
    assert not loose, ("counts no test checks (add a Claim to tests/test_docs_counts.py, or say why in NOT_COUNTS):\n"
                       + "\n".join(loose))
    seen = {(str(p.relative_to(REPO)), " ".join(m.group(0).split()))
            for p in _pages() for m in SWEEP.finditer(p.read_text())}
    assert set(NOT_COUNTS) <= seen, f"NOT_COUNTS entries no page has any more: {sorted(set(NOT_COUNTS) - seen)}"


def test_the_sweep_finds_counts() -> None:
    """The sweep itself: the phrases that went stale before are found, a single one is not."""
    found = [m.group(0) for m in SWEEP.finditer("all 16 RPCs of; the six a current; three newer asks; 22 tools; "
                                                "one tool each; 4 MiB")]
    assert found == ["16 RPCs", "three newer asks", "22 tools"], found
