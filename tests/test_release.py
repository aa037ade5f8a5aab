"""One version, said the same way everywhere: the installed package (setuptools-scm, counting from the
last release: a `v*` tag or a RELEASES line, .ci/version --describe), `uibus --version`,
`uibus_build_info` on /metrics and the image's OCI label. A release commit, a commit after it (with
or without the tag in the clone) and an archive without .git get three distinct, honest versions;
the changelog has every release RELEASES names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from uibus import version
from uibus.app import App
from uibus.infra.config import Config

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FALLBACK = PYPROJECT["tool"]["setuptools_scm"]["fallback_version"]
# Releases, after them (a dirty tree adds the date), or the fallback (0+unknown.g<hash>: a shallow clone).
HONEST = re.compile(r"\d+\.\d+\.\d+|\d+\.\d+\.\d+\.dev\d+\+g[0-9a-f]{7,40}(\.d\d{8})?|"
                    + re.escape(FALLBACK) + r"(\.g[0-9a-f]{7,40}(\.d\d{8})?)?")  # the last: a shallow clone


def _releases(root: Path = REPO) -> list[tuple[str, str]]:
    """(version, commit) of each RELEASES line."""
    lines = (root / "RELEASES").read_text().splitlines()
    return [(f[0], f[1]) for f in (line.split("#", 1)[0].split() for line in lines) if f]


def _scm(root: Path, **env: str) -> str:
    """What setuptools-scm makes of `root` (as the build backend would), run in its own process."""
    out = subprocess.run([sys.executable, "-m", "setuptools_scm", "--root", str(root)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **env}, cwd=root, check=True)
    return out.stdout.strip().splitlines()[-1]


async def test_version_command_build_info_and_package_agree(tmp_path: Path) -> None:
    installed = metadata.version("uibus")
    assert installed == version() and HONEST.fullmatch(installed), installed
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
    setuptools-scm answers the fallback, which is no release and sorts below every one, or the version
    the Dockerfile passes it."""
    tree = tmp_path / "src"
    tree.mkdir()
    shutil.copy(REPO / "pyproject.toml", tree)
    assert subprocess.run(["git", "rev-parse"], cwd=tree, capture_output=True, timeout=60).returncode != 0
    assert _scm(tree) == FALLBACK
    from packaging.version import Version

    fallback = Version(FALLBACK)
    assert fallback.local and all(fallback < Version(v) for v, _ in _releases()), FALLBACK
    assert _scm(tree, SETUPTOOLS_SCM_PRETEND_VERSION_FOR_UIBUS="7.8.9") == "7.8.9"


def _ci_version(root: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(root / ".ci" / "version"), *args], capture_output=True, text=True,
                          timeout=60, cwd=root, check=True)
    return done.stdout.strip()


def test_in_the_repository_the_version_counts_from_the_last_release() -> None:
    """In a checkout, setuptools-scm and .ci/version agree, and count from the last release, tagged or
    not (CI's clone may carry no tags): never from the root, never below that release."""
    from packaging.version import Version

    derived = _scm(REPO)
    assert derived == _ci_version(REPO) and HONEST.fullmatch(derived), derived
    assert _ci_version(REPO, "--tag") == derived.replace("+", "-")
    last, commit = _releases()[-1]
    assert Version(derived) >= Version(last), derived
    since = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD"], cwd=REPO, capture_output=True,
                           text=True, check=True, timeout=60).stdout.strip()
    if since != "0":
        assert Version(derived).dev == int(since), (derived, since)


def test_release_tags_and_the_record_agree() -> None:
    """Each RELEASES line names a full commit of this history; where its `v` tag is in the clone, it
    is an annotated tag on that same commit."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)

    assert _releases(), "RELEASES names no release"
    for release, commit in _releases():
        assert re.fullmatch(r"\d+\.\d+\.\d+", release) and re.fullmatch(r"[0-9a-f]{40}", commit), (release, commit)
        assert git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, f"{release}: {commit} not in history"
        if git("rev-parse", "-q", "--verify", f"refs/tags/v{release}").returncode == 0:
            assert git("cat-file", "-t", f"v{release}").stdout.strip() == "tag", f"v{release}: annotate it"
            assert git("rev-parse", f"v{release}^{{commit}}").stdout.strip() == commit, release


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
    assert releases[0] == "Unreleased" and {v for v, _ in _releases()} <= set(releases), releases
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

    pinned = git("rev-parse", f"{PREVIOUS}^{{commit}}").stdout.strip()
    head = git("rev-parse", "HEAD").stdout.strip()
    recorded = [commit for _, commit in _releases() if commit != head]  # HEAD's own: the release being made
    assert recorded and recorded[-1] == pinned, f"the last release is {recorded[-1:]}; move PREVIOUS to it"
    last = git("describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", "HEAD^")
    if last.returncode != 0:  # no release tag in this clone's history (CI's clone may carry none)
        return
    tag = last.stdout.strip()
    tagged = git("rev-parse", f"{tag}^{{commit}}").stdout.strip()
    assert tagged == pinned, f"the last release is {tag} ({tagged[:7]}); move PREVIOUS in tests/test_rolling_upgrade.py"
    assert f"## [{tag.removeprefix('v')}]" in (REPO / "CHANGELOG.md").read_text(), tag


def _build_inputs(tree: Path) -> None:
    """What a build of uibus reads (the Dockerfile's COPY list, and .ci/version for the describe)."""
    ignore = shutil.ignore_patterns("__pycache__", "pb", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / name, tree / name)
    for name in ("protos", "server", "clients"):
        shutil.copytree(REPO / name, tree / name, ignore=ignore)
    (tree / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "version", tree / ".ci" / "version")


def _uibus_version(tree: Path, work: Path) -> str:
    """`uibus --version` of `tree` as pip builds and installs it (a wheel, installed into a folder of its
    own that is first on the path, ahead of the checkout's editable install)."""
    wheels, target = work / "wheels", work / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(tree)], check=True, capture_output=True,
                   timeout=300, cwd=work)
    (wheel,) = wheels.glob("uibus-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=120)
    code = ("import sys, uibus; assert uibus.__file__.startswith(sys.argv[1]), uibus.__file__; "
            "from uibus.clients.cli import main; sys.argv = ['uibus', '--version']; main()")
    done = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(target)}, cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip()
    assert said == f"uibus {wheel.name.split('-')[1]}", (said, wheel.name)
    return said.removeprefix("uibus ")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_release_a_commit_after_it_and_an_archive_say_three_honest_versions(tmp_path: Path) -> None:
    """A history of this tree's build inputs: commit A released as 3.4.5 (an annotated tag), B records
    it in RELEASES, C comes after. A checkout of the tag says 3.4.5; C says 3.4.6.dev2+g<C> from a
    clone with the tag and from one without tags (the record); `git archive` of C (no .git) says the
    fallback, no release. `uibus --version` of each, as pip builds and installs it."""
    def git(cwd: Path, *args: str) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
        return subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false",
                               "-c", "tag.gpgsign=false", *args], cwd=cwd, check=True, capture_output=True,
                              text=True, timeout=120, env=env).stdout.strip()

    origin = tmp_path / "origin"
    origin.mkdir()
    _build_inputs(origin)
    (origin / "RELEASES").write_text("# version  commit  date\n")
    git(origin, "init", "-q")
    git(origin, "add", "-A")
    git(origin, "commit", "-q", "-m", "3.4.5")
    a = git(origin, "rev-parse", "HEAD")
    git(origin, "tag", "-a", "v3.4.5", "-m", "uibus 3.4.5")
    (origin / "RELEASES").write_text(f"# version  commit  date\n3.4.5  {a}  2026-12-03\n")
    git(origin, "commit", "-q", "-am", "record 3.4.5")
    git(origin, "commit", "-q", "--allow-empty", "-m", "after 3.4.5")
    c = git(origin, "rev-parse", "--short", "HEAD")

    tagged, untagged, archive = tmp_path / "tagged", tmp_path / "untagged", tmp_path / "archive"
    git(tmp_path, "clone", "-q", "--branch", "v3.4.5", str(origin), str(tagged))
    git(tmp_path, "clone", "-q", "--no-tags", str(origin), str(untagged))
    assert not git(untagged, "tag")
    archive.mkdir()
    with subprocess.Popen(["git", "-C", str(origin), "archive", "--format=tar", "HEAD"], stdout=subprocess.PIPE) as tar:
        subprocess.run(["tar", "-x", "-C", str(archive)], stdin=tar.stdout, check=True, timeout=120)
    assert tar.returncode == 0 and not (archive / ".git").exists()

    said = {}
    for name, tree in (("tagged", tagged), ("untagged", untagged), ("with tags", origin), ("archive", archive)):
        work = tmp_path / f"build-{name.replace(' ', '-')}"
        work.mkdir()
        said[name] = _uibus_version(tree, work)
    assert said["tagged"] == "3.4.5", said
    assert said["untagged"] == said["with tags"] == f"3.4.6.dev2+g{c}", said
    assert said["archive"] == FALLBACK, said
    assert len({said["tagged"], said["untagged"], said["archive"]}) == 3
    # A shallow clone that lacks the release commit cannot count: the fallback, naming its commit.
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{origin}", str(shallow))
    assert _scm(shallow) == _ci_version(shallow) == f"0+unknown.g{c}"
