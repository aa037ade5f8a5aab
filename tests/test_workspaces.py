"""A workspace per conversation (docs/hosting/isolation.md, Workspaces): agents with option
`workspace = "worktree"` work each in its own `git worktree` of the repository at their `cwd`, on a
branch of their session.

Real parts throughout: real `git` repositories made in tmp dirs, the real pi 0.73 in RPC mode whose
scripted model (tests/pikit.py) asks it to write and read files with its own tools, real uibus apps
(one, one restarted, two replicas on a real redis-server), the sessions API over gRPC and HTTP.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.chatkit import request, write_agents
from tests.conftest import free_port, require, require_binary, shots, start_app, wait_for
from tests.pikit import PI, Reply, agent_pids, hosting, pi_agent, scripted_model, turn_of
from tests.redisproc import RedisProcess, redis_server
from tests.replicakit import replicas
from tests.test_acp_agent import ACP_DIR, fixture_agent, fixture_log
from uibus.agents.config import load_agents
from uibus.agents.workspaces import TRUNCATED, Workspaces, session_key
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config, InvalidConfig
from uibus.pb.neuro_san.api.grpc import agent_pb2
from uibus.pb.uibus.v1 import sessions_pb2 as pb
from uibus.pb.uibus.v1 import sessions_pb2_grpc

__all__ = ["redis_server"]  # the fixture

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def make_repo(tmp_path: Path) -> Path:
    """A real repository with one commit: README.md."""
    require_binary("git")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "README.md").write_text("# the project\n")
    git(repo, "add", "README.md")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "first")
    return repo


def worktree_pi(tmp_path: Path, model: Any, repo: Path, **options: Any) -> dict[str, Any]:
    entry = pi_agent(tmp_path, model, workspace="worktree", **options)
    entry["options"]["cwd"] = str(repo)
    return entry


def branches(repo: Path) -> list[str]:
    return sorted(git(repo, "branch", "--list", "uibus/*", "--format=%(refname:short)").split())


def need_pi() -> None:
    require("the pinned pi agent (npm ci --prefix tests/pi)", PI.exists(), "node")


async def final(target: str, session: str, text: str) -> str:
    async with Connection(target, session=session) as conn:
        return str((await turn_of(conn, "pi", text))[-1].response.text)


def md(session: str) -> tuple[tuple[str, str], ...]:
    return (("x-uibus-session", session),)


# ---- two conversations, two rooms ---------------------------------------------------------------


@pytest.mark.node
async def test_two_sessions_write_the_same_file_in_two_worktrees_and_the_api_shows_each_diff(
        config: Config, tmp_path: Path) -> None:
    need_pi()
    repo = make_repo(tmp_path)
    head = git(repo, "rev-parse", "HEAD").strip()
    spaces_dir = tmp_path / "spaces"
    async with scripted_model() as model:
        model.script(Reply(tool=("write", {"path": "note.txt", "content": "from a\n"})), Reply(text="Wrote a."),
                     Reply(tool=("write", {"path": "note.txt", "content": "from b\nand more\n"})),
                     Reply(tool=("bash", {"command": "git add -A && git -c user.name=pi -c user.email=pi@example.com "
                                                     "commit -qm 'b works' && echo committed"})),
                     Reply(text="Wrote and committed b."))
        async with hosting(config, tmp_path, [worktree_pi(tmp_path, model, repo)],
                           workspaces_dir=str(spaces_dir), http_port=free_port()) as app:
            target = f"127.0.0.1:{app.port}"
            assert await final(target, "a-1", "write note.txt") == "Wrote a."
            spaces = app.core.agent_sessions.workspaces
            assert spaces is not None
            a_path, b_path = spaces.path_of("a-1", "pi", str(repo)), spaces.path_of("a-2", "pi", str(repo))
            assert agent_pids(a_path) != []  # the agent runs in its worktree
            assert await final(target, "a-2", "write note.txt and commit") == "Wrote and committed b."

            # two repositories of their own, a branch in each; the checkout at cwd untouched
            assert (a_path / "note.txt").read_text() == "from a\n"
            assert (b_path / "note.txt").read_text() == "from b\nand more\n"
            assert not (repo / "note.txt").exists()
            assert git(repo, "status", "--porcelain") == "" and git(repo, "rev-parse", "HEAD").strip() == head
            branch_a, branch_b = f"uibus/{session_key('a-1')}/pi", f"uibus/{session_key('a-2')}/pi"
            assert branches(repo) == []  # nothing of a conversation's in the base repository
            assert git(a_path, "symbolic-ref", "--short", "HEAD").strip() == branch_a
            assert git(b_path, "log", "-1", "--format=%s", branch_b).strip() == "b works"
            assert git(a_path, "rev-parse", branch_a).strip() == head  # a's work is uncommitted
            assert git(a_path, "branch", "--list", "--format=%(refname:short)").split() == [branch_a]
            assert git(b_path, "branch", "--list", "--format=%(refname:short)").split() == [branch_b]
            assert spaces.created == 2

            # the sessions API: each session's branch and what changed against the base
            async with grpc.aio.insecure_channel(target) as ch:
                api = sessions_pb2_grpc.SessionServiceStub(ch)
                listed = {s.session: s for s in (await api.ListSessions(pb.ListSessionsRequest())).sessions}
                (wa,), (wb,) = listed["a-1"].workspaces, listed["a-2"].workspaces
                assert (wa.agent, wa.branch, wa.base, wa.files_changed, wa.lines_added, wa.lines_removed,
                        wa.commits) == ("pi", branch_a, head, 1, 1, 0, 0)
                assert (wb.branch, wb.files_changed, wb.lines_added, wb.commits) == (branch_b, 1, 2, 1)
                diff = await api.GetWorkspaceDiff(pb.AgentRequest(agent="pi"), metadata=md("a-1"))
                assert [(f.path, f.lines_added, f.lines_removed) for f in diff.files] == [("note.txt", 1, 0)]
                assert "+from a" in diff.diff and "from b" not in diff.diff and not diff.truncated
                with pytest.raises(grpc.aio.AioRpcError) as none:
                    await api.GetWorkspaceDiff(pb.AgentRequest(agent="pi"), metadata=md("no-such"))
                assert none.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await api.GetWorkspaceDiff(pb.AgentRequest(), metadata=md("a-1"))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                async with httpx.AsyncClient() as http:  # the same over the HTTP API
                    got = await http.post(f"http://127.0.0.1:{app.http_port}/api/v1/sessions/GetWorkspaceDiff",
                                          json={"agent": "pi"}, headers={"x-uibus-session": "a-2"})
                    assert got.status_code == 200, got.text
                    assert "+and more" in got.json()["diff"] and got.json()["workspace"]["commits"] == 1

                # deleting frees the workspace: a's branch had no commits (gone), b's is exported and said
                gone = await api.DeleteSession(pb.DeleteSessionRequest(), metadata=md("a-1"))
                assert (gone.agents_closed, list(gone.workspaces_removed), list(gone.branches_kept)) == (1, ["pi"], [])
                kept = await api.DeleteSession(pb.DeleteSessionRequest(), metadata=md("a-2"))
                assert list(kept.workspaces_removed) == ["pi"] and list(kept.branches_kept) == [branch_b]
            assert not a_path.exists() and not b_path.exists()
            assert not spaces.private_of("a-1", str(repo)).exists() and not spaces.private_of("a-2", str(repo)).exists()
            assert git(repo, "log", "-1", "--format=%s", branch_b).strip() == "b works"  # the export
            assert branches(repo) == [branch_b]
            assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
            assert agent_pids(a_path) == [] and agent_pids(b_path) == []
            assert git(repo, "status", "--porcelain") == "" and not (repo / "note.txt").exists()


@pytest.mark.node
async def test_a_shared_agent_keeps_working_in_cwd(config: Config, tmp_path: Path) -> None:
    """`workspace = "shared"` (the default) is today's behaviour: the checkout itself, no worktree."""
    need_pi()
    repo = make_repo(tmp_path)
    async with scripted_model() as model:
        model.script(Reply(tool=("write", {"path": "note.txt", "content": "shared\n"})), Reply(text="Done."))
        entry = worktree_pi(tmp_path, model, repo)
        entry["options"]["workspace"] = "shared"
        async with hosting(config, tmp_path, [entry], workspaces_dir=str(tmp_path / "spaces")) as app:
            assert await final(f"127.0.0.1:{app.port}", "s", "write") == "Done."
            assert (repo / "note.txt").read_text() == "shared\n" and branches(repo) == []
            assert not (tmp_path / "spaces" / "sessions").exists()


# ---- a resumed conversation reopens its workspace -----------------------------------------------


@pytest.mark.node
async def test_a_restarted_uibus_resumes_into_the_same_workspace(config: Config, tmp_path: Path) -> None:
    need_pi()
    repo = make_repo(tmp_path)
    spaces_dir = tmp_path / "spaces"
    async with scripted_model() as model:
        model.script(Reply(tool=("write", {"path": "note.txt", "content": "walnut\n"})), Reply(text="Noted."),
                     Reply(tool=("bash", {"command": "cat note.txt; pwd"})), Reply(text="Read it."))
        entry = worktree_pi(tmp_path, model, repo)
        store = str(tmp_path / "kept.db")
        async with hosting(config, tmp_path, [entry], workspaces_dir=str(spaces_dir), store=store) as first:
            assert await final(f"127.0.0.1:{first.port}", "r", "note walnut") == "Noted."
            assert first.core.agent_sessions.workspaces.created == 1  # type: ignore[union-attr]
        path = Workspaces(str(spaces_dir)).path_of("r", "pi", str(repo))
        assert agent_pids(path) == [] and (path / "note.txt").exists()
        async with hosting(config, tmp_path, [entry], workspaces_dir=str(spaces_dir), store=store) as second:
            assert await final(f"127.0.0.1:{second.port}", "r", "what did you note?") == "Read it."
            spaces = second.core.agent_sessions.workspaces
            assert spaces is not None and (spaces.created, spaces.reused) == (0, 1)
            tool_output = json.dumps(model.requests[3]["messages"])
            assert "walnut" in tool_output and str(path) in tool_output  # the same workspace, its file
        assert branches(repo) == [] and git(path, "symbolic-ref", "--short", "HEAD").strip().startswith("uibus/")


@pytest.mark.node
async def test_a_second_replica_resumes_into_the_same_workspace(tmp_path: Path, redis_server: RedisProcess) -> None:
    need_pi()
    repo = make_repo(tmp_path)
    spaces_dir = tmp_path / "spaces"  # the volume both replicas mount
    async with scripted_model() as model:
        model.script(Reply(tool=("write", {"path": "note.txt", "content": "hazel\n"})), Reply(text="Noted."),
                     Reply(tool=("bash", {"command": "cat note.txt; pwd"})), Reply(text="Read it."))
        entry = worktree_pi(tmp_path, model, repo, idle_seconds=0.5)
        async with replicas(tmp_path, redis_server, [entry], workspaces_dir=str(spaces_dir)) as apps:
            a, b = apps
            assert await final(f"127.0.0.1:{a.port}", "rep", "note hazel") == "Noted."
            await wait_for(lambda: a.core.agent_sessions.count() == 0 and not a.placement.ownership.held,  # type: ignore[attr-defined]
                           timeout=20, what="the idle agent on A to close and give its lease up")
            assert await final(f"127.0.0.1:{b.port}", "rep", "what did you note?") == "Read it."
            assert b.core.agent_sessions.count() == 1  # hosted on B now
            sa, sb = a.core.agent_sessions.workspaces, b.core.agent_sessions.workspaces
            assert sa is not None and sb is not None
            assert (sa.created, sb.created, sb.reused) == (1, 0, 1)
            path = sb.path_of("rep", "pi", str(repo))
            assert "hazel" in json.dumps(model.requests[3]["messages"]) and agent_pids(path) != []
            # deleted on A, which does not host the agent: B's agent is closed, the workspace goes
            async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
                gone = await sessions_pb2_grpc.SessionServiceStub(ch).DeleteSession(
                    pb.DeleteSessionRequest(), metadata=md("rep"))
            assert list(gone.workspaces_removed) == ["pi"] and not path.exists() and branches(repo) == []
            await wait_for(lambda: b.core.agent_sessions.count() == 0, timeout=20,
                           what="B to close the agent of the deleted session")


# ---- the parts, with real git -------------------------------------------------------------------


async def test_first_turns_at_once_make_one_worktree_and_paths_are_deterministic(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    spaces = Workspaces(str(tmp_path / "spaces"))
    same = await asyncio.gather(*(spaces.open("one", "pi", str(repo)) for _ in range(4)))
    assert len(set(same)) == 1 and (spaces.created, spaces.reused) == (1, 3)
    odd = ["../../etc", "a b/c", ".lock", "x.lock", "@{u}", "ü" * 80, "-", ""]
    made = await asyncio.gather(*(spaces.open(s, "pi", str(repo)) for s in odd))  # at once, one repository
    assert len({w.path for w in made}) == len(odd) and len({w.branch for w in made}) == len(odd)
    for w in made:
        assert Path(w.path).parent.parent.parent == tmp_path / "spaces" / "sessions"
        git(repo, "check-ref-format", f"refs/heads/{w.branch}")
    # another process computes the same path
    assert Workspaces(str(tmp_path / "spaces")).path_of("a b/c", "pi", str(repo)) == Path(made[1].path)
    (Path(same[0].path) / "big.txt").write_text("".join(f"line {i}\n" for i in range(20000)))
    summary, text, cut = await spaces.diff(same[0], limit=1000)
    assert cut and text.endswith(TRUNCATED.format(limit=1000)) and len(text) < 1200
    assert (summary.files_total, summary.added) == (1, 20000)
    _, whole, cut = await spaces.diff(same[0])  # ~230 KB: under the bound, read to its end, not to a pipe's fill
    assert not cut and whole.count("\n+line ") == 20000 and whole.endswith("+line 19999\n")
    for s in ["one", *odd]:
        await spaces.remove_session(s)
    assert branches(repo) == [] and git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    assert list((tmp_path / "spaces" / "sessions").iterdir()) == []
    assert list((tmp_path / "spaces" / "private").iterdir()) == []


def test_the_workspace_option_is_checked(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()

    def entry(**options: Any) -> dict[str, Any]:
        return {"name": "pi", "backend": "rpc", "options": {"command": ["/bin/cat"], **options}}

    for options, message in (
            ({"workspace": "clone", "cwd": str(repo)}, "option workspace must be one of shared, worktree"),
            ({"workspace": "worktree"}, "needs option cwd"),
            ({"workspace": "worktree", "cwd": str(plain)}, "is not in a git repository")):
        with pytest.raises(InvalidConfig, match=message):
            load_agents(write_agents(tmp_path, [entry(**options)]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"workspaces_dir": "relative/dir", "agents": [entry()]}))
    with pytest.raises(InvalidConfig, match="workspaces_dir must be an absolute path"):
        load_agents(str(bad))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"workspaces_dir": str(tmp_path / "w"),
                                "agents": [entry(workspace="worktree", cwd=str(repo))]}))
    assert load_agents(str(good)).workspaces_dir == str(tmp_path / "w")


async def test_the_agents_file_names_the_workspaces_dir_and_the_flag_wins(config: Config, tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    path = tmp_path / "agents.json"
    path.write_text(json.dumps({"workspaces_dir": str(tmp_path / "from-file"), "agents": [
        {"name": "pi", "backend": "rpc", "options": {"command": ["/bin/cat"], "cwd": str(repo),
                                                     "workspace": "worktree"}}]}))
    app: App = await start_app(replace(config, agents=str(path)))
    try:
        assert app.core.agent_sessions.workspaces.root == str(tmp_path / "from-file")  # type: ignore[union-attr]
    finally:
        await app.aclose()
    app = await start_app(replace(config, agents=str(path), workspaces_dir=str(tmp_path / "flag")))
    try:
        assert app.core.agent_sessions.workspaces.root == str(tmp_path / "flag")  # type: ignore[union-attr]
    finally:
        await app.aclose()


def test_a_relative_workspaces_dir_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="--workspaces-dir: must be an absolute path"):
        Config(workspaces_dir="spaces")


@pytest.mark.node
async def test_the_page_shows_each_sessions_branch_and_diff(config: Config, tmp_path: Path, browser: Any) -> None:
    """Headless Chromium: the session list names each session's branch and changes; the open
    session's Workspaces panel shows the files and the unified diff of its own worktree only."""
    need_pi()
    repo = make_repo(tmp_path)
    async with scripted_model() as model:
        model.script(Reply(tool=("write", {"path": "note.txt", "content": "from a\n"})), Reply(text="Wrote a."),
                     Reply(tool=("write", {"path": "note.txt", "content": "<b>from b</b>\n"})), Reply(text="Wrote b."))
        async with hosting(config, tmp_path, [worktree_pi(tmp_path, model, repo)],
                           workspaces_dir=str(tmp_path / "spaces"), http_port=free_port()) as app:
            target = f"127.0.0.1:{app.port}"
            assert await final(target, "a-1", "write") == "Wrote a."
            assert await final(target, "a-2", "write") == "Wrote b."
            page = await browser.new_page(viewport={"width": 1300, "height": 900})
            try:
                await page.goto(f"http://127.0.0.1:{app.http_port}/?session=a-1")
                await page.wait_for_selector('#status[data-state="live"]', timeout=10_000)
                await page.wait_for_selector('#session-list li[data-session="a-2"] .s-ws', timeout=10_000)
                assert await page.text_content('#session-list li[data-session="a-2"] .s-ws') == "pi +1 −0"
                assert await page.locator('#session-list li[data-session="a-2"] .s-ws svg.icon').count() == 1
                row = '#workspaces .ws-row[data-agent="pi"]'
                await page.wait_for_selector(row, timeout=10_000)
                assert await page.text_content(f"{row} .ws-changes") == "1 file +1 −0"
                assert session_key("a-1") in (await page.text_content(f"{row} .ws-open") or "")
                await page.click(f"{row} .ws-open")
                await page.wait_for_selector("#workspace-diff:not([hidden]) .ws-diff", timeout=10_000)
                diff = await page.text_content("#workspace-diff .ws-diff") or ""
                assert "+from a" in diff and "from b" not in diff
                assert await page.text_content("#workspace-diff .ws-files li .ws-path") == "note.txt"
                assert await page.locator("#workspace-diff .ws-diff span.add").count() >= 1
                await page.screenshot(path=str(shots(tmp_path) / "workspaces-a1.png"), full_page=True)

                await page.click('#session-list li[data-session="a-2"]')  # the other session: its own diff
                await page.wait_for_function("() => document.querySelector('#workspace-diff').hidden", timeout=10_000)
                await page.wait_for_function(
                    "k => (document.querySelector('#workspaces .ws-open')?.textContent || '').includes(k)",
                    arg=session_key("a-2"), timeout=10_000)
                await page.click(f"{row} .ws-open")
                await page.wait_for_selector("#workspace-diff:not([hidden]) .ws-diff", timeout=10_000)
                diff = await page.text_content("#workspace-diff .ws-diff") or ""
                assert "+<b>from b</b>" in diff and "from a" not in diff  # text, never markup
                assert await page.locator("#workspace-diff .ws-diff b").count() == 0
                await page.screenshot(path=str(shots(tmp_path) / "workspaces-a2.png"), full_page=True)

                # Export…: the work becomes a branch of the base repository, named in the prompt
                page.once("dialog", lambda d: asyncio.ensure_future(d.accept("from-the-page")))
                await page.click("#workspace-diff .ws-export")
                exported = ["git", "-C", str(repo), "rev-parse", "--verify", "-q", "refs/heads/from-the-page"]
                await wait_for(lambda: subprocess.run(exported, capture_output=True).returncode == 0,
                               timeout=10, what="the exported branch in the base repository")
                assert git(repo, "show", "from-the-page:note.txt") == "<b>from b</b>\n"
            finally:
                await page.close()


async def test_an_edited_workspace_file_cannot_point_a_delete_elsewhere(tmp_path: Path) -> None:
    """A workspace's record (`<agent>.json`, in uibus's private folder) is read back only if it
    describes its own place: one edited to point at another directory is ignored."""
    repo = make_repo(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious\n")
    spaces = Workspaces(str(tmp_path / "spaces"))
    made = await spaces.open("s", "pi", str(repo))
    meta = spaces.private_of("s", str(repo)) / "pi.json"
    assert not Path(made.path).with_name("pi.json").exists()  # nothing of uibus's beside the checkout
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "path": str(victim)}))
    assert await spaces.workspaces("s") == []
    await spaces.remove_session("s")
    assert (victim / "keep.txt").read_text() == "precious\n"
    meta.write_text(json.dumps(data))  # put back: found again, and removed
    assert [w.path for w in await spaces.workspaces("s")] == [made.path]
    assert (await spaces.remove_session("s")).removed and not Path(made.path).exists()


async def test_summaries_keep_their_own_index_and_never_touch_the_agents(tmp_path: Path) -> None:
    """uibus stages a workspace into a git directory of its own, in its private folder: the agent's
    index is never touched, and nothing of uibus's lies in the agent's repository."""
    repo = make_repo(tmp_path)
    spaces = Workspaces(str(tmp_path / "spaces"))
    w = await spaces.open("s", "pi", str(repo))
    (Path(w.path) / "new.txt").write_text("a\nb\n")
    own_index = Path(git(Path(w.path), "rev-parse", "--path-format=absolute", "--git-path", "index").strip())
    before = own_index.read_bytes()
    first, second = await asyncio.gather(spaces.summary(w, fresh=True), spaces.summary(w, fresh=True))
    assert first.files_total == second.files_total == 1 and first.added == 2 and not first.error
    assert own_index.read_bytes() == before and git(Path(w.path), "status", "--porcelain") == "?? new.txt\n"
    git_dir = Path(git(Path(w.path), "rev-parse", "--path-format=absolute", "--git-dir").strip())
    assert git_dir == Path(w.path) / ".git" and not (git_dir / "uibus-index").exists()
    shadow = spaces.private_of("s", str(repo)) / "pi.shadow"
    assert (shadow / "index").exists()
    await spaces.remove_session("s")
    assert not git_dir.exists() and not shadow.exists()


@pytest.mark.node
async def test_a_caller_that_names_no_session_gets_a_throwaway_worktree(config: Config, tmp_path: Path) -> None:
    """No `x-uibus-session`: a one-shot agent, whose conversation is not kept; its worktree is its
    own too, and goes when its turn ends (its branch with it, having no commits)."""
    need_pi()
    repo = make_repo(tmp_path)
    spaces_dir = tmp_path / "spaces"
    async with scripted_model() as model:
        model.script(Reply(tool=("bash", {"command": "echo scratch > scratch.txt; pwd"})), Reply(text="Done."))
        async with hosting(config, tmp_path, [worktree_pi(tmp_path, model, repo)],
                           workspaces_dir=str(spaces_dir)) as app:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                chat = ch.unary_stream("/pi.AgentService/StreamingChat",
                                       request_serializer=agent_pb2.ChatRequest.SerializeToString,
                                       response_deserializer=agent_pb2.ChatResponse.FromString)
                answers = [r async for r in chat(request("scratch"))]
            assert answers[-1].response.text == "Done."
            where = json.dumps(model.requests[1]["messages"])
            assert f"{spaces_dir}/sessions/repo-" in where and "/default-one-shot-" in where
            assert not (repo / "scratch.txt").exists() and branches(repo) == []
            assert list((spaces_dir / "sessions").iterdir()) == []
            assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


@pytest.mark.node
async def test_an_acp_agent_opens_its_conversation_in_its_worktree_and_resumes_it_there(
        config: Config, tmp_path: Path) -> None:
    """ACP: `session/new` names the worktree as the conversation's cwd, and after an idle close the
    new process's `session/load` names the same one (the handle's cwd matches: no fresh start)."""
    require("the ACP SDK (npm ci --prefix tests/acp)", (ACP_DIR / "node_modules" / "@agentclientprotocol").is_dir(),
            "node")
    repo = make_repo(tmp_path)
    entry = fixture_agent(tmp_path, idle_seconds=0.3, workspace="worktree")
    entry["options"]["cwd"] = str(repo)
    state = tmp_path / "acp-state"
    state.mkdir()
    entry["options"]["env"]["ACP_FIXTURE_STATE"] = str(state)
    async with hosting(config, tmp_path, [entry], workspaces_dir=str(tmp_path / "spaces")) as app:
        sessions = app.core.agent_sessions
        async with Connection(f"127.0.0.1:{app.port}", session="acp-ws") as conn:
            assert (await turn_of(conn, "acp", "one"))[-1].response.text == "Turn 1: one"
            await wait_for(lambda: sessions.closed_idle == 1 and sessions.count() == 0, timeout=10,
                           what="the idle close")
            assert (await turn_of(conn, "acp", "two"))[-1].response.text == "Turn 2: two"
        path = str(Workspaces(str(tmp_path / "spaces")).path_of("acp-ws", "acp", str(repo)))
        (new,) = [e["session/new"] for e in fixture_log(tmp_path) if "session/new" in e]
        (load,) = [e["session/load"] for e in fixture_log(tmp_path) if "session/load" in e]
        assert new["cwd"] == path and load["cwd"] == path
        assert (sessions.handles.resumed, sessions.handles.resume_failed) == (1, 0)
        assert sessions.workspaces is not None and (sessions.workspaces.created, sessions.workspaces.reused) == (1, 1)


async def test_a_delete_frees_the_disk_even_when_the_repository_is_gone(tmp_path: Path) -> None:
    """The base repository moved away: nothing can be exported to it, and the workspace's
    directory and uibus's files of it go all the same."""
    repo = make_repo(tmp_path)
    spaces = Workspaces(str(tmp_path / "spaces"))
    w = await spaces.open("s", "pi", str(repo))
    repo.rename(tmp_path / "moved")
    removed = await spaces.remove_session("s")
    assert [x.agent for x in removed.removed] == ["pi"] and removed.kept_branches == ()
    assert not Path(w.path).exists() and not spaces.private_of("s", str(repo)).exists()


async def test_a_deleted_sessions_commits_are_exported_by_a_restarted_uibus(tmp_path: Path) -> None:
    """Another process (a restart, another replica) deletes the session: the workspace's commits
    become branch `uibus/<key>/<agent>` of the base repository (named as kept), then it goes."""
    repo = make_repo(tmp_path)
    w = await Workspaces(str(tmp_path / "spaces")).open("s", "pi", str(repo))
    (Path(w.path) / "work.txt").write_text("kept\n")
    git(Path(w.path), "add", "work.txt")
    git(Path(w.path), "-c", "user.name=a", "-c", "user.email=a@a", "commit", "-qm", "the work")
    removed = await Workspaces(str(tmp_path / "spaces")).remove_session("s")
    assert removed.kept_branches == (w.branch,) and not Path(w.path).exists()
    assert git(repo, "log", "-1", "--format=%s", w.branch).strip() == "the work"
    assert git(repo, "show", f"{w.branch}:work.txt") == "kept\n"
