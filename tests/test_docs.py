"""The documentation is checked like code: the docs site builds with no warning (a broken link, an
anchor that is not there or a page missing from the nav fails), the reference pages say what the
code says, the configuration table names every knob `uibus serve` has, the README stays a short
front door that links every topic, and nothing in the code points at a file outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import yaml

from tests import docs_gen
from tests.conftest import REPO
from uibus.config import Config

DOCS = REPO / "docs"


def test_configuration_page_documents_every_serve_flag() -> None:
    """The hand-written table users read first (docs/configuration.md) names every flag with its env var,
    so a new setting cannot ship undocumented (docs/reference/cli.md lists them too, generated)."""
    page = (DOCS / "configuration.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    missing = []
    for f in fields(Config):
        flag, env = "--" + f.name.replace("_", "-"), "UIBUS_" + f.name.upper()
        if not any(f"`{flag}`" in row and f"`{env}`" in row for row in rows):
            missing.append(f"{flag} ({env})")
    assert not missing, f"docs/configuration.md's table lacks: {', '.join(missing)}"


def test_reference_pages_match_the_code() -> None:
    """docs/reference/*.md regenerated from the parser, the metrics registry and the protos equal the
    committed pages; the message says the one command that fixes it."""
    pages = docs_gen.render_all()
    cli = pages["cli.md"]
    for f in fields(Config):  # the generator itself must not lose a flag
        assert f"`--{f.name.replace('_', '-')}` | `UIBUS_{f.name.upper()}`" in cli, f.name
    assert "`uibus_rpc_duration_seconds` | histogram" in pages["metrics.md"]
    assert "`uibus_replication_bad_total` | counter | with `--redis-url`" in pages["metrics.md"]
    assert ("| `subscribeToPartialMessage` | `cline.EmptyRequest` | `cline.ClineMessage` | server stream |"
            in pages["rpcs.md"])
    diffs = docs_gen.stale(pages)
    assert not diffs, ("stale reference pages, run `.venv/bin/python -m tests.docs_gen`:\n"
                       + "\n".join(diffs.values())[:4000])


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` from mkdocs.yml: every warning (a link to a missing page or anchor, a
    page left out of the nav) fails the build. Built into a temporary directory, not ./site."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                          "--config-file", str(REPO / "mkdocs.yml")], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()
    # The diagram is kept as text: one Mermaid block on the architecture page, rendered as such.
    assert '<pre class="mermaid">' in (tmp_path / "site" / "architecture" / "index.html").read_text()


def _nav_pages(nav: list) -> list[str]:  # type: ignore[type-arg]
    found: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            found.extend(_nav_pages(value))
        else:
            found.append(value)
    return found


def test_every_page_is_in_the_nav() -> None:
    """Every Markdown file under docs/ is reachable from the site's navigation (and the three pages other
    work fills in are among them)."""
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # BaseLoader: !!python tags
    nav = set(_nav_pages(config["nav"]))
    files = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert files == nav, f"not in the nav: {sorted(files - nav)}; in the nav, no file: {sorted(nav - files)}"
    assert {"hosting/isolation.md", "security/quotas.md", "streams/resume.md"} <= nav


def test_readme_is_a_short_front_door() -> None:
    """The README is what a newcomer reads in five minutes: at most 250 lines, a current feature list
    first, the two commands, and every page of the site one link away."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    features = readme[readme.index("## What it does"):readme.index("## The two commands")]
    for feature in ("Cline `UiService`", "neuro-san", "Extension UI", "CodeBolt", "MCP", "Hosted coding agents",
                    "ACP for editors", "Replicas", "Redis"):
        assert feature in features, feature
    assert "bash .ci/serve" in readme and "bash .ci/test" in readme
    assert readme.index("## What it does") < readme.index("## The two commands") < readme.index("## Documentation")
    linked = set(re.findall(r"\]\(docs/([^)#]+)", readme))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"
    for target in linked:
        assert (DOCS / target).is_file(), target


def test_the_two_commands_exist() -> None:
    """The README's and the site's two commands name scripts that are there (and CI's entry point)."""
    for script in (".ci/serve", ".ci/test", ".ci/run"):
        assert (REPO / script).is_file(), script
    assert "bash .ci/serve" in (DOCS / "getting-started.md").read_text()
    assert "bash .ci/test" in (DOCS / "getting-started.md").read_text()


def test_no_reference_outside_the_repository() -> None:
    """Docstrings and comments in the code say what they mean or link a docs page: the product spec
    (SPEC.md) is not part of the repository, so a reader could not follow `SPEC.md §n`."""
    hits = [f"{p.relative_to(REPO)}:{n}" for root in ("server", "clients")
            for p in (REPO / root).rglob("*.py") if "pb" not in p.relative_to(REPO).parts
            for n, line in enumerate(p.read_text().splitlines(), 1) if "SPEC.md" in line]
    assert not hits, f"references to SPEC.md, which is not in the repository: {hits}"
