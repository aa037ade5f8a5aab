"""One version, said the same way everywhere: the installed package (from git tags by setuptools-scm),
`uibus --version`, `uibus_build_info` on /metrics and the image's OCI label; a tree without .git
(an archive, the image's build context, CI's fresh clone without tags) still gets a sane version;
and the changelog starts with the release the fallback names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from uibus import version
from uibus.app import App
from uibus.infra.config import Config

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FALLBACK = PYPROJECT["tool"]["setuptools_scm"]["fallback_version"]


def _scm(root: Path, **env: str) -> str:
    """What setuptools-scm makes of `root` (as the build backend would), run in its own process."""
    out = subprocess.run([sys.executable, "-m", "setuptools_scm", "--root", str(root)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **env}, cwd=root, check=True)
    return out.stdout.strip().splitlines()[-1]


async def test_version_command_build_info_and_package_agree(tmp_path: Path) -> None:
    installed = metadata.version("uibus")
    assert installed == version() and re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", installed), installed
    said = subprocess.run([sys.executable, "-m", "uibus", "--version"], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()
    assert said == f"uibus {installed}"
    cfg = Config(host="127.0.0.1", port=0, http_port=0, store=str(tmp_path / "u.db"), grace_seconds=1.0)
    async with App(cfg) as app:
        assert app.metrics is not None
        families = {f.name: f for f in text_string_to_metric_families(app.metrics.render().decode())}
    (sample,) = families["uibus_build_info"].samples
    assert sample.labels == {"version": installed} and sample.value == 1


def test_a_tree_without_git_gets_the_fallback_and_a_build_argument_wins(tmp_path: Path) -> None:
    """A source tree outside any git checkout (an archive, the image's build context: no .git, no tags).
    setuptools-scm answers the fallback, or the version the Dockerfile passes it."""
    tree = tmp_path / "src"
    tree.mkdir()
    shutil.copy(REPO / "pyproject.toml", tree)
    assert subprocess.run(["git", "rev-parse"], cwd=tree, capture_output=True, timeout=60).returncode != 0
    assert _scm(tree) == FALLBACK
    assert _scm(tree, SETUPTOOLS_SCM_PRETEND_VERSION_FOR_UIBUS="7.8.9") == "7.8.9"


def test_in_the_repository_the_version_comes_from_git() -> None:
    """In a checkout it is derived from git: the latest tag, or after the fallback when there is none
    (a fresh clone without tags: `0.1.1.devN`, N the commits since the root), never below the fallback."""
    derived = _scm(REPO)
    from packaging.version import Version

    assert Version(derived) >= Version(FALLBACK), derived
    tags = subprocess.run(["git", "tag", "--merged", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout.split()
    if not tags:
        assert Version(derived).is_devrelease, derived


def test_the_image_label_is_the_version_the_package_is_built_with() -> None:
    """The Dockerfile's one VERSION build argument is both what setuptools-scm is told for the wheel
    (the context has no .git) and the OCI label, so `docker run IMAGE uibus --version` and
    `docker inspect` agree by construction; its default is the fallback (tests/test_deploy.py also
    keeps compose and the k8s base on it). Read, not built: tests/test_container.py builds the image."""
    text = (REPO / "Dockerfile").read_text()
    build, final = text.split("FROM ${BASE} AS build", 1)[1].split("\nFROM ${BASE}\n", 1)
    head = text.split("FROM ${BASE} AS build", 1)[0]
    assert re.search(rf"^ARG VERSION={re.escape(FALLBACK)}$", head, re.MULTILINE)
    assert re.search(r"^ARG VERSION$", build, re.MULTILINE) and re.search(r"^ARG VERSION$", final, re.MULTILINE)
    assert re.search(r'SETUPTOOLS_SCM_PRETEND_VERSION_FOR_UIBUS="\$\{VERSION\}" pip wheel [^\n]* \.$', build,
                     re.MULTILINE)
    assert 'org.opencontainers.image.version="${VERSION}"' in final
    assert "org.opencontainers.image.revision" not in final or "${REVISION}" in final


def test_changelog_follows_keep_a_changelog() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "keepachangelog.com" in text
    releases = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert releases[0] == "Unreleased" and FALLBACK in releases, releases
    sections = set(re.findall(r"^### (\w+)", text, re.MULTILINE))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections


def test_the_upgrade_test_runs_against_the_last_tagged_release() -> None:
    """tests/test_rolling_upgrade.py pins the previous release by commit (a clone without tags still
    has it); once a newer release is tagged, that pin must move to it, or the upgrade test would keep
    checking an upgrade nobody makes. The last release tag before HEAD (HEAD's own tag is the release
    being made) must be the pinned commit. A clone without release tags has nothing to compare."""
    from tests.test_rolling_upgrade import PREVIOUS

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)

    last = git("describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", "HEAD^")
    if last.returncode != 0:  # no release tag in this clone's history (CI's clone may carry none)
        assert git("cat-file", "-e", f"{PREVIOUS}^{{commit}}").returncode == 0, PREVIOUS
        return
    tag = last.stdout.strip()
    tagged = git("rev-parse", f"{tag}^{{commit}}").stdout.strip()
    pinned = git("rev-parse", f"{PREVIOUS}^{{commit}}").stdout.strip()
    assert tagged == pinned, f"the last release is {tag} ({tagged[:7]}); move PREVIOUS in tests/test_rolling_upgrade.py"
    assert f"## [{tag.removeprefix('v')}]" in (REPO / "CHANGELOG.md").read_text(), tag
