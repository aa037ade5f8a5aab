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

import pytest
import yaml

from tests import docs_gen
from tests.conftest import REPO, require
from uibus.infra.config import Config

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


@pytest.mark.node
def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` from mkdocs.yml: every warning (a link to a missing page or anchor, a
    page left out of the nav) fails the build. Built into a temporary directory, not ./site. The
    build needs docs-site's npm packages (the site's own Mermaid; tests/test_docs_offline.py)."""
    require("docs-site's npm packages (.ci/setup: npm ci --prefix docs-site)",
            (REPO / "docs-site/node_modules/mermaid/dist/mermaid.min.js").is_file(), "node")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                          "--config-file", str(REPO / "mkdocs.yml")], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()
    # The diagram is kept as text: one Mermaid block on the architecture page, rendered as such.
    assert '<pre class="mermaid">' in (tmp_path / "site" / "architecture" / "index.html").read_text()
    # Python-Markdown, unlike GitHub, needs a blank line before a list and 4 spaces for a list item's
    # later blocks; without them a list is swallowed into the paragraph above it with no warning.
    swallowed = []
    for page in sorted((tmp_path / "site").rglob("index.html")):
        body = re.sub(r"<pre.*?</pre>", "", page.read_text(), flags=re.DOTALL)
        swallowed += [f"{page.parent.relative_to(tmp_path / 'site')}: {para[:80]!r}"
                      for para in re.findall(r"<p>(.*?)</p>", body, flags=re.DOTALL)
                      if re.search(r"\n\s*(?:[*-]|\d+\.) ", para)]
    assert not swallowed, f"list items rendered as paragraph text (a blank line or an indent missing): {swallowed}"


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


CODE_ROOTS = ("server", "clients", "bench", "tests")  # docstrings and comments that must stay followable


def _code_lines() -> list[tuple[str, str]]:
    """(path:line, text) of every Python line in the code roots, but generated code, npm trees and
    this file (whose checks name what they look for)."""
    out = []
    for root in CODE_ROOTS:
        for p in sorted((REPO / root).rglob("*.py")):
            rel = p.relative_to(REPO)
            if "pb" in rel.parts or "node_modules" in rel.parts or rel == Path("tests/test_docs.py"):
                continue
            out += [(f"{rel}:{n}", line) for n, line in enumerate(p.read_text().splitlines(), 1)]
    return out


def test_no_reference_outside_the_repository() -> None:
    """Docstrings and comments in the code say what they mean or link a docs page: the product spec
    (SPEC.md) is not part of the repository, so a reader could not follow `SPEC.md §n`."""
    hits = [where for where, line in _code_lines() if re.search(r"\bSPEC(\.md|\s*§)", line)]
    assert not hits, f"references to SPEC.md, which is not in the repository: {hits}"
    # The spec's "seeds" (shared/seeds/: the protocols it started from) are not here either: name the
    # upstream source (pi's RPC docs, Cline's ui.proto) instead.
    seeds = [where for where, line in _code_lines() if re.search(r"\bseeds/|\bthe seed\b|\bseed's\b", line)]
    assert not seeds, f"references to the spec's seeds, which are not in the repository: {seeds}"
    # Nor is the issue tracker: "(issue 42)" tells a reader of the code nothing; the docs page does.
    issues = [where for where, line in _code_lines() if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert not issues, f"references to tracker issues (name the docs page or say it): {issues}"


def test_no_reference_to_a_readme_section_that_moved() -> None:
    """The README's long sections moved to docs/ (the README is now a front door), so code citing
    "README, Security model" or "as the README gives it" sends a reader nowhere: it names the docs
    page. A path to another README (bench/README.md) must exist, and a section quoted after a
    Markdown file (bench/README.md "Hosted agents") must be one of its headings."""
    bare, missing, sections = [], [], []
    for where, line in _code_lines():
        if re.search(r"(?<![\w/.\"'])README(?!\.md\b)(?!\w)", line) \
                or re.search(r"(?<![\w/\"'])README\.md[,:]?\s*[\"§(]", line):
            bare.append(where)
        for path in re.findall(r"\b([\w.-]+(?:/[\w.-]+)*/README(?:\.md)?)\b", line):
            if not ((REPO / path).is_file() or (REPO / f"{path}.md").is_file()):
                missing.append(f"{where}: {path}")
        for path, title in re.findall(r"\b([\w./-]+\.md),? \"([^\"]+)\"", line):
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.MULTILINE) \
                if (REPO / path).is_file() else []
            if not any(h.startswith(title) for h in headings):
                sections.append(f"{where}: {path} \"{title}\"")
    assert not bare, f"references to the README's sections, which moved to docs/ (name the page): {bare}"
    assert not missing, f"paths to READMEs that do not exist: {missing}"
    assert not sections, f"sections that are not headings of the file named: {sections}"
