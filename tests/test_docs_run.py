"""Every shell and Python block of README.md and docs/** runs as printed, in order, against a
server started the way the docs start it (`bash .ci/serve`): one test per block, named by its page
and line. Which blocks run, and the `<!-- docs-test: … -->` marks that leave one out (with its
reason, naming the test that covers it; listed at the end of the run, never a pytest skip) or run
it in the background, are in tests/docs_blocks.py and docs/index.md ("Commands in these pages").

The blocks run in one pass (tests/docs_run.py, in a network namespace of its own where it can make
one) before the first of these tests; each test reports its block's result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.docs_blocks import ROOT, Block, all_blocks

BLOCKS = all_blocks()
# The whole pass: the server's start (and, on a fresh checkout, .ci/serve's install) and every block.
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def docs_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # .ci/serve installs what serving needs on its first run, which needs the package index: done
    # here, on this machine's network (`--help`: serve's flags, then exit), so that the run below,
    # without a network, finds it installed and only serves.
    prep = subprocess.run(["bash", ".ci/serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert prep.returncode == 0, f"bash .ci/serve --help: {prep.returncode}\n{prep.stdout}\n{prep.stderr}"
    out = tmp_path_factory.mktemp("docs") / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UIBUS_")}
    run = subprocess.run([sys.executable, "-m", "tests.docs_run", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert run.returncode == 0 and out.exists(), f"tests.docs_run: {run.returncode}\n{run.stdout}\n{run.stderr}"
    data = json.loads(out.read_text())
    return {"isolated": data["isolated"], "results": {r["where"]: r for r in data["results"]}}


def test_docs_blocks_are_found() -> None:
    """The extraction itself: the pages' command blocks are seen (a parser that finds none would
    pass every page), and the marks name real directives."""
    where = {b.where for b in BLOCKS}
    assert {"README.md", "docs/getting-started.md"} <= {b.page for b in BLOCKS}, where
    assert any(b.server for b in BLOCKS), "no block is marked `docs-test: server`"
    assert sum(1 for b in BLOCKS if b.lang == "python") >= 1, where
    runnable = [b for b in BLOCKS if not b.skip]
    assert 2 * len(runnable) > len(BLOCKS), f"most blocks are skipped: {[b.where for b in BLOCKS if b.skip]}"


RUN = [b for b in BLOCKS if not b.skip]


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_docs_block(block: Block, docs_results: dict[str, Any]) -> None:
    result = docs_results["results"].get(block.where)
    assert result is not None, f"{block.where}: no result"
    assert result["status"] != "skip", f"{block.where}: the runner skipped a block without a mark"
    if result["status"] == "unrunnable":
        require(f"the docs' ports for {block.where} ({result['reason']})", False)
    server = docs_results["results"].get("server", {}).get("output", "")
    assert result["status"] == "ok", (
        f"{block.where} ({block.lang} block) failed: {result['reason']}\n"
        f"--- the block ---\n{block.text}--- its output ---\n{result['output']}"
        + (f"\n--- the server's log (end) ---\n{server[-2000:]}" if server else ""))


def test_skips_say_why() -> None:
    """A skipped block names its reason in the page (the marker parser refuses an empty one); the
    list is short on purpose: a command in the docs that cannot run here is the exception."""
    skipped = {b.where: b.skip for b in BLOCKS if b.skip}
    assert all(len(reason) >= 10 for reason in skipped.values()), skipped
    # Not run here is not untested: each marked block names the test that covers what it does (a
    # file that exists), or is the suite itself (`.ci/test`). They are listed at the end of every
    # run (conftest's terminal summary), not as pytest skips: CI runs no skipped test.
    for block in (b for b in BLOCKS if b.skip):
        named = [ROOT / m for m in re.findall(r"tests/test_\w+\.py", block.skip)]
        assert ".ci/test" in block.text or (named and all(p.exists() for p in named)), (
            f"{block.where}: its skip names no existing test that covers it: {block.skip!r}")


def test_marks_sit_before_blocks(tmp_path: Path) -> None:
    """A mark not right before a fence, or an unknown directive, is an error, not silently ignored."""
    from tests.docs_blocks import page_blocks

    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip a reason -->\n\ntext\n```sh\ntrue\n```\n")
    with pytest.raises(ValueError, match="right before"):
        page_blocks(page)
    page.write_text("<!-- docs-test: skipp typo -->\n```sh\ntrue\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test directive"):
        page_blocks(page)
    page.write_text("<!-- docs-test: skip -->\n```sh\ntrue\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        page_blocks(page)
    page.write_text("<!-- docs-test: background; expect hi -->\n```console\n$ echo hi \\\n  there\nhi there\n```\n")
    (b,) = page_blocks(page)
    assert b.background and b.expect == ["hi"] and b.script() == "echo hi \\\n  there\n"


def test_the_runner_fails_what_fails(tmp_path: Path) -> None:
    """The runner itself, on a page of its own: a failing command, a missing expected text, a block
    that never ends, a background block that fails, each fail with their reason; a skip is a skip;
    a python block may `await` at top level; blocks of a page share the page's background."""
    page = tmp_path / "page.md"
    page.write_text(
        "```sh\nfalse\necho never\n```\n\n"
        "<!-- docs-test: expect bye -->\n```bash\necho hi\n```\n\n"
        "<!-- docs-test: timeout 1 -->\n```sh\nsleep 30\n```\n\n"
        "<!-- docs-test: background -->\n```sh\nexit 3\n```\n\n"
        "<!-- docs-test: background; expect later -->\n```sh\nsleep 0.5; echo later; sleep 60\n```\n\n"
        "<!-- docs-test: skip not here, for a reason -->\n```sh\nfalse\n```\n\n"
        "<!-- docs-test: expect py-ok 1 -->\n"
        "```python\nimport asyncio\nawait asyncio.sleep(0)\nprint('py-ok', 1)\n```\n\n"
        "```console\n$ echo from-console\nfrom-console\n```\n")
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, "-m", "tests.docs_run", str(out), str(page)], cwd=ROOT, check=True, timeout=120,
                   stdin=subprocess.DEVNULL, capture_output=True)
    results = {int(r["where"].rsplit(":", 1)[1]): (r["status"], r["reason"], r["output"])
               for r in json.loads(out.read_text())["results"]}
    got = [results[line] for line in sorted(results)]  # in the page's order
    assert got[0][:2] == ("fail", "exit status 1") and "never" not in got[0][2], got[0]
    assert got[1][0] == "fail" and "lacks 'bye'" in got[1][1], got[1]
    assert got[2][0] == "fail" and "still running after 1 s" in got[2][1], got[2]
    assert got[3][:2] == ("fail", "exit status 3 before the page ended"), got[3]
    assert got[4][0] == "ok" and "later" in got[4][2], got[4]
    assert got[5][:2] == ("skip", "not here, for a reason"), got[5]
    assert got[6][0] == "ok", got[6]
    assert got[7][0] == "ok" and got[7][2] == "from-console\n", got[7]
