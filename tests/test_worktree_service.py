"""Cline's worktree panel (cline.WorktreeService, upstream's worktree.proto unmodified) over uibus's
workspaces, driven by the pinned @grpc/grpc-js client (tests/grpcjs/worktree.js) against a real
server; and, Python-side, the merge's safety: merging a workspace into the base repository runs no
hook, filter or merge driver of the agent's.

Real parts throughout: real git repositories in tmp dirs, a real uibus app on loopback whose agent
has option workspace = "worktree", the host's side through HostService. The agent's own work is
made by plain git in its workspace, as an agent's `git commit` would make it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.chatkit import write_agents
from tests.conftest import REPO, free_port, require, require_binary, start_app
from tests.test_grpcurl import grpcurl
from uibus.agents import worktree_ops as ops
from uibus.agents.workspaces import Workspaces, session_key
from uibus.app import App
from uibus.infra.config import Config
from uibus.pb.cline import worktree_pb2

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

HERE = REPO / "tests" / "grpcjs"
ID = ("-c", "user.name=t", "-c", "user.email=t@example.com")


def git(repo: Path | str, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def commit(repo: Path | str, message: str, **files: str) -> str:
    for name, text in files.items():
        Path(repo, name).write_text(text)
    git(repo, "add", "-A")
    git(repo, *ID, "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").strip()


def make_repo(tmp_path: Path) -> Path:
    """The operator's project: `main` checked out (README.md, .gitignore), and a branch `dev`."""
    require_binary("git")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "first", **{"README.md": "# the project\nline two\n", ".gitignore": "node_modules/\n.env\n"})
    git(repo, "branch", "dev")
    return repo


def agents_of(repo: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """`coder` has a worktree per conversation; `plain` works in a folder of its own (no worktrees).
    Neither runs here: the worktree panel makes and reads workspaces, it does not start agents."""
    plain = tmp_path / "plain"
    plain.mkdir(exist_ok=True)
    return [{"name": "coder", "backend": "acp", "description": "a worktree agent",
             "options": {"command": ["/bin/true"], "cwd": str(repo), "workspace": "worktree"}},
            {"name": "plain", "backend": "acp", "description": "an agent without worktrees",
             "options": {"command": ["/bin/true"], "cwd": str(plain)}}]


async def serving(config: Config, tmp_path: Path, repo: Path) -> App:
    return await start_app(replace(config, agents=write_agents(tmp_path, agents_of(repo, tmp_path)),
                                   workspaces_dir=str(tmp_path / "spaces"), http_port=free_port()))


async def calls(app: App, session: str, *steps: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs `steps` (see tests/grpcjs/worktree.js) through grpc-js; what each got."""
    node = shutil.which("node")
    require("the pinned @grpc/grpc-js (bash .ci/setup)",
            node is not None and (HERE / "node_modules" / "@grpc" / "grpc-js").is_dir(), "node")
    assert node is not None
    proc = await asyncio.create_subprocess_exec(node, str(HERE / "worktree.js"), f"127.0.0.1:{app.port}", session,
                                                json.dumps(list(steps)), stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    got = json.loads(out)
    assert isinstance(got, list), got
    return got


def call(rpc: str, request: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"rpc": rpc, "request": request or {}, **extra}


def test_the_proto_is_upstreams() -> None:
    """Served as upstream wrote it: every RPC, and the fields the panel reads."""
    service = worktree_pb2.DESCRIPTOR.services_by_name["WorktreeService"]
    assert service.full_name == "cline.WorktreeService"
    assert sorted(m.name for m in service.methods) == sorted([
        "listWorktrees", "createWorktree", "deleteWorktree", "switchWorktree", "getAvailableBranches",
        "getWorktreeDefaults", "getWorktreeIncludeStatus", "createWorktreeInclude", "checkoutBranch",
        "mergeWorktree", "trackWorktreeViewOpened"])
    merged = worktree_pb2.MergeWorktreeResult.DESCRIPTOR.fields_by_name
    assert merged["conflicting_files"].number == 4 and merged["has_conflicts"].number == 3
    text = (REPO / "protos" / "cline" / "worktree.proto").read_text()
    assert 'import "cline/common.proto";' in text and text.count("import ") == 1


async def test_reflection_lists_it_and_an_app_without_worktree_agents_says_why(app: App) -> None:
    """grpcurl finds the service and its methods by reflection; with no agent configured for
    worktrees (the built-in agent), a call is FAILED_PRECONDITION naming the option."""
    rc, out, err = await grpcurl(app.port, "list")
    assert rc == 0 and "cline.WorktreeService" in out.split(), err
    rc, out, err = await grpcurl(app.port, "list", "cline.WorktreeService")
    assert rc == 0 and "cline.WorktreeService.mergeWorktree" in out.split(), err
    rc, out, err = await grpcurl(app.port, "cline.WorktreeService/listWorktrees")
    assert rc != 0 and "FailedPrecondition" in err and 'workspace = "worktree"' in err, err
    rc, out, err = await grpcurl(app.port, "cline.WorktreeService/trackWorktreeViewOpened", data='{"source": "x"}')
    assert rc == 0 and json.loads(out) == {}, err


@pytest.mark.node
async def test_every_rpc_of_the_worktree_panel_with_grpc_js(config: Config, tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    first = git(repo, "rev-parse", "HEAD").strip()
    app = await serving(config, tmp_path, repo)
    try:
        spaces = app.core.agent_sessions.workspaces
        assert spaces is not None
        branch = f"uibus/{session_key('wt-1')}/coder"
        where = str(spaces.path_of("wt-1", "coder", str(repo)))

        (track, defaults, listed, branches, include, made_include, include_after, elsewhere, other_branch, made,
         again, listed_after, not_worktree, unknown, unheard, switched) = await calls(
            app, "wt-1",
            call("trackWorktreeViewOpened", {"source": "home_page"}),
            call("getWorktreeDefaults"),
            call("listWorktrees"),
            call("getAvailableBranches"),
            call("getWorktreeIncludeStatus"),
            call("createWorktreeInclude", {"content": ".env\n"}),
            call("getWorktreeIncludeStatus"),
            call("createWorktree", {"path": str(tmp_path / "elsewhere"), "branch": branch, "create_new_branch": True}),
            call("createWorktree", {"path": where, "branch": "feature/x", "create_new_branch": True}),
            call("createWorktree", {"path": where, "branch": branch, "create_new_branch": True}),
            call("createWorktree", {"path": where, "branch": branch, "create_new_branch": True}),
            call("listWorktrees"),
            call("checkoutBranch", {"branch": "dev"}, agent="plain"),
            call("deleteWorktree", {"path": str(tmp_path / "nope")}),
            call("switchWorktree", {"path": where, "new_window": True}),
            call("switchWorktree", {"path": where, "new_window": True}, host=True))
        assert track == {"reply": {}}
        assert defaults == {"reply": {"suggested_branch": branch, "suggested_path": where}}
        assert listed["reply"]["is_git_repo"] and listed["reply"]["git_root_path"] == str(repo)
        assert [(w["path"], w["branch"], w["commit_hash"], w["is_current"]) for w in listed["reply"]["worktrees"]] \
            == [(str(repo), "main", first, True)]
        assert branches["reply"] == {"local_branches": ["dev", "main"], "remote_branches": [], "current_branch": "main"}
        assert include["reply"] == {"exists": False, "has_gitignore": True,
                                    "gitignore_content": "node_modules/\n.env\n"}
        assert made_include["reply"]["success"] and (repo / ".worktreeinclude").read_text() == ".env\n"
        assert include_after["reply"]["exists"] is True
        # uibus owns where a workspace lives and what its branch is called, and says which it takes
        assert elsewhere["code"] == "INVALID_ARGUMENT" and where in elsewhere["details"]
        assert other_branch["code"] == "INVALID_ARGUMENT" and branch in other_branch["details"]
        assert made["reply"]["success"], made
        assert made["reply"]["worktree"]["path"] == where and made["reply"]["worktree"]["branch"] == branch
        assert made["reply"]["worktree"]["commit_hash"] == first
        assert again["code"] == "ALREADY_EXISTS"
        assert [(w["path"], w["branch"], w["is_current"]) for w in listed_after["reply"]["worktrees"]] == [
            (str(repo), "main", False), (where, branch, True)]
        assert not_worktree["code"] == "FAILED_PRECONDITION" and 'workspace = "worktree"' in not_worktree["details"]
        assert unknown["code"] == "NOT_FOUND"
        assert unheard["code"] == "FAILED_PRECONDITION" and "no host" in unheard["details"]
        assert switched["reply"]["success"]
        assert switched["host"]["open_folder"] == {"path": where, "new_window": True}
        # the workspace is the one the agent's first turn opens: its record is there
        assert [w.path for w in spaces.of_session("wt-1")] == [where]
        assert git(repo, "status", "--porcelain") == "?? .worktreeinclude\n"

        # the agent works: a commit on its branch
        work = commit(where, "add a feature", **{"feature.txt": "new\n"})
        out, back, missing, merged, bad_target, listed_merged = await calls(
            app, "wt-1",
            call("checkoutBranch", {"branch": "dev"}),
            call("checkoutBranch", {"branch": branch}),
            call("checkoutBranch", {"branch": "no-such-branch"}),
            call("mergeWorktree", {"worktree_path": where, "target_branch": "main"}),
            call("mergeWorktree", {"worktree_path": where, "target_branch": "nope"}),
            call("listWorktrees"))
        assert out["reply"]["success"] and back["reply"]["success"]
        assert git(where, "symbolic-ref", "--short", "HEAD").strip() == branch
        assert git(where, "rev-parse", "dev").strip() == first  # made from the base repository's `dev`
        assert missing["code"] == "NOT_FOUND"
        assert merged["reply"] == {"success": True, "message": f"Successfully merged '{branch}' into 'main'",
                                   "has_conflicts": False, "conflicting_files": [], "source_branch": branch,
                                   "target_branch": "main"}
        assert git(repo, "rev-parse", "main").strip() == work  # a fast-forward, as `git merge` makes
        assert (repo / "feature.txt").read_text() == "new\n"  # the checkout of main moved with it
        assert git(repo, "status", "--porcelain") == "?? .worktreeinclude\n"
        assert git(repo, "for-each-ref", "refs/uibus") == ""  # the fetched work's ref is gone
        assert bad_target["code"] == "NOT_FOUND"
        assert listed_merged["reply"]["worktrees"][0]["commit_hash"] == work

        # a second conversation, whose work conflicts with the operator's
        branch2 = f"uibus/{session_key('wt-2')}/coder"
        where2 = str(spaces.path_of("wt-2", "coder", str(repo)))
        (made2,) = await calls(app, "wt-2", call("createWorktree"))
        assert made2["reply"]["worktree"]["path"] == where2 and made2["reply"]["worktree"]["branch"] == branch2
        commit(where2, "agent edits line two", **{"README.md": "# the project\nthe agent's line\n"})
        main_before = commit(repo, "operator edits line two", **{"README.md": "# the project\nthe operator's\n"})
        Path(where2, "scratch.txt").write_text("not committed\n")
        dirty_merge, dirty_delete = await calls(
            app, "wt-2",
            call("mergeWorktree", {"worktree_path": where2, "target_branch": "dev"}),
            call("deleteWorktree", {"path": where2}))
        assert dirty_merge["reply"]["success"] is False and dirty_merge["reply"]["has_conflicts"] is False
        assert "uncommitted" in dirty_merge["reply"]["message"]
        assert dirty_delete["code"] == "FAILED_PRECONDITION" and "uncommitted" in dirty_delete["details"]
        os.unlink(Path(where2, "scratch.txt"))
        conflict, base_merge = await calls(
            app, "wt-2",
            call("mergeWorktree", {"worktree_path": where2, "target_branch": "main"}),
            call("mergeWorktree", {"worktree_path": str(repo), "target_branch": "main"}))
        assert conflict["reply"] == {"success": False, "message": "Merge conflict detected. 1 file(s) have conflicts.",
                                     "has_conflicts": True, "conflicting_files": ["README.md"],
                                     "source_branch": branch2, "target_branch": "main"}
        assert git(repo, "rev-parse", "main").strip() == main_before  # nothing moved
        assert git(repo, "status", "--porcelain") == ""  # (the operator's commit took .worktreeinclude in)
        assert base_merge["code"] == "FAILED_PRECONDITION" and "base repository" in base_merge["details"]
        Path(where2, "scratch.txt").write_text("lost with force\n")
        (forced,) = await calls(app, "wt-2", call("deleteWorktree", {"path": where2, "force": True}))
        # deleted as DeleteSession deletes: its unmerged commits kept as a branch of the base repository
        assert forced["reply"]["success"] and branch2 in forced["reply"]["message"]
        assert git(repo, "log", "-1", "--format=%s", branch2).strip() == "agent edits line two"
        assert not Path(where2).exists() and spaces.of_session("wt-2") == []

        # merged work, merged again and deleted after: nothing is kept (it is in main)
        (done,) = await calls(app, "wt-1", call("mergeWorktree", {"worktree_path": where, "target_branch": "main",
                                                                  "delete_after_merge": True}))
        assert done["reply"]["success"] and "removed worktree" in done["reply"]["message"], done
        assert not Path(where).exists() and spaces.of_session("wt-1") == []
        assert git(repo, "branch", "--list", branch) == ""
        (gone,) = await calls(app, "wt-1", call("mergeWorktree", {"worktree_path": where, "target_branch": "main"}))
        assert gone["code"] == "NOT_FOUND"
    finally:
        await app.aclose()


# ---- the merge runs nothing of the agent's (Python side, the same code the service runs) ----------


def plant(path: Path, marker: Path) -> None:
    """A hook that says it ran."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {path.name} >> {marker}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def agent_git(ws: Path | str, *args: str) -> str:
    """The test's own git in a workspace (the agent's commits), its plants switched off for it."""
    return git(ws, "-c", "core.hooksPath=/dev/null", "-c", "filter.x.clean=cat", "-c", "filter.x.smudge=cat", *ID,
               *args)


def agent_commit(ws: Path | str, message: str, **files: str) -> None:
    for name, text in files.items():
        Path(ws, name).write_text(text)
    agent_git(ws, "add", "-A")
    agent_git(ws, "commit", "-qm", message)


def side_commit(repo: Path, parent: str, name: str, text: str) -> str:
    """A commit on `parent` adding one file, made with plumbing (no checkout moves)."""
    env = {**os.environ, "GIT_INDEX_FILE": str(repo / ".git" / "test-index")}
    run = lambda *a, **kw: subprocess.run(["git", "-C", str(repo), *ID, *a], env=env, check=True,  # noqa: E731
                                          capture_output=True, text=True, **kw).stdout.strip()
    blob = run("hash-object", "-w", "--stdin", input=text)
    run("read-tree", parent)
    run("update-index", "--add", "--cacheinfo", f"100644,{blob},{name}")
    return run("commit-tree", run("write-tree"), "-p", parent, "-m", f"add {name}")


def plant_workspace(ws: Path, marker: Path) -> None:
    """Hooks, a filter and a merge driver in the workspace's config, and attributes naming them."""
    for hook in ("post-merge", "post-commit", "pre-commit", "post-checkout", "reference-transaction", "pre-push"):
        plant(ws / ".git" / "hooks" / hook, marker)
    trap = f"sh -c 'echo ran >> {marker}; cat'"
    git(ws, "config", "filter.x.smudge", trap)
    git(ws, "config", "filter.x.clean", trap)
    git(ws, "config", "merge.evil.driver", f"sh -c 'echo agent-driver >> {marker}; exit 1'")


async def test_a_merge_runs_no_hook_filter_or_driver_of_the_agents(tmp_path: Path) -> None:
    """The agent's workspace carries hooks, a filter and a merge driver in its config, and a committed
    `.gitattributes` naming them; the base repository's own config even defines that driver and asks
    for renormalization (which makes git read the merged trees' attributes), and has a post-merge
    hook. A fast-forward into the checked-out branch, a conflicting merge and a real merge commit run
    none of them: the marker they would write never appears. The plants are real: git's default
    merge runs the driver, and the workspace's hook and filter run when git runs in the workspace."""
    repo = make_repo(tmp_path)
    marker = tmp_path / "MARKER"
    git(repo, "config", "merge.evil.driver", f"sh -c 'echo driver >> {marker}; exit 1'")
    git(repo, "config", "merge.renormalize", "true")
    plant(repo / ".git" / "hooks" / "post-merge", marker)
    spaces = Workspaces(str(tmp_path / "spaces"), enabled=True)

    w = await spaces.open("s-1", "coder", str(repo))
    plant_workspace(Path(w.path), marker)
    agent_commit(w.path, "attributes", **{".gitattributes": "* filter=x merge=evil\n"})
    agent_commit(w.path, "agent edit", **{"README.md": "# the project\nthe agent's line two\n"})
    assert not marker.exists()
    merged = await ops.merge(spaces, w, "main")  # a fast-forward of the checked-out main
    assert merged.ok, merged
    assert (repo / ".gitattributes").read_text() == "* filter=x merge=evil\n"
    assert git(repo, "status", "--porcelain") == ""
    assert not marker.exists(), marker.read_text()

    # both sides change line two: git's content merge runs where a driver would be chosen
    w2 = await spaces.open("s-2", "coder", str(repo))
    before = commit(repo, "operator's line", **{"README.md": "# the project\nthe operator's line two\n"})
    plant_workspace(Path(w2.path), marker)
    agent_commit(w2.path, "agent edit 2", **{"README.md": "# the project\nanother agent's line two\n"})
    conflicted = await ops.merge(spaces, w2, "main")
    assert (conflicted.ok, conflicted.conflicts) == (False, ("README.md",))
    assert git(repo, "rev-parse", "main").strip() == before and git(repo, "status", "--porcelain") == ""

    # a branch checked out nowhere, diverged: a merge commit, moved by its ref alone
    w3 = await spaces.open("s-3", "coder", str(repo))
    plant_workspace(Path(w3.path), marker)
    agent_commit(w3.path, "on dev", **{"dev.txt": "x\n"})
    git(repo, "branch", "-f", "dev", side_commit(repo, before, "only-dev.txt", "y\n"))
    on_dev = await ops.merge(spaces, w3, "dev")
    assert on_dev.ok, on_dev
    assert git(repo, "rev-list", "--parents", "-1", "dev").split()[1:] == [
        git(repo, "rev-parse", "dev~1").strip(), git(w3.path, "rev-parse", "HEAD").strip()]
    assert git(repo, "show", "dev:dev.txt") == "x\n" and git(repo, "show", "dev:only-dev.txt") == "y\n"
    assert not (repo / "dev.txt").exists() and git(repo, "rev-parse", "main").strip() == before
    assert not marker.exists(), marker.read_text()
    assert git(repo, "for-each-ref", "refs/uibus") == ""

    # the plants are real: git's default merge of the same work runs the driver its attributes name ...
    git(repo, "fetch", "-q", str(Path(w2.path) / ".git"), f"{w2.branch}:refs/test/agent")
    subprocess.run(["git", "-C", str(repo), "merge-tree", "--write-tree", "main", "refs/test/agent"],
                   capture_output=True, check=False)
    assert marker.read_text().split() == ["driver"]
    # ... and the workspace's hook and filter run when git runs in the workspace
    marker.unlink()
    git(w2.path, *ID, "commit", "-q", "--allow-empty", "-m", "hooked")
    Path(w2.path, "README.md").unlink()
    git(w2.path, "checkout", "--", "README.md")
    assert {"pre-commit", "post-commit", "ran"} <= set(marker.read_text().split())
