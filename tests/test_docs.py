"""The configuration tables users read (the README's, and the flag tables of the docs pages under
docs/, e.g. docs/security/quotas.md) must name every flag `uibus serve` has, with its env var, so a
new setting cannot ship undocumented."""

from __future__ import annotations

from dataclasses import fields

from tests.conftest import REPO
from uibus.config import Config


def test_readme_documents_every_serve_flag() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Configuration"):readme.index("## How it behaves")]
    for page in sorted((REPO / "docs").rglob("*.md")):
        table += "\n" + page.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    missing = []
    for f in fields(Config):
        flag, env = "--" + f.name.replace("_", "-"), "UIBUS_" + f.name.upper()
        if not any(f"`{flag}`" in row and f"`{env}`" in row for row in rows):
            missing.append(f"{flag} ({env})")
    assert not missing, f"README's configuration table (or a docs page's) lacks: {', '.join(missing)}"
