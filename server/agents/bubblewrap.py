"""What a sandboxed agent sees, as bubblewrap's command line (`bwrap_argv`), and the checks at
start-up that a sandbox can start here as promised (`sandbox_problem`, `program_problem`).

The sandbox: the system (/usr, /etc, …) read-only with the host's secrets masked, the agent's own
installation read-only (found from its command: `installation_of`), its working directory
read-write (and, for a configured git worktree, of the repository's common .git directory only
what committing writes: objects, refs, logs, its own admin folder — `_git_writable`), its tenant's
home read-write at HOME with the operator's configuration files read-only inside it, its tenant's
own /tmp, new user, PID, IPC and UTS namespaces with its own /proc, no capability, a seccomp filter
(uibus.agents.seccomp), and nothing of uibus's: every path uibus names as its own (state
directory, store, tokens file, TLS files, agents file) is masked wherever it would otherwise show
through. gVisor (uibus.agents.gvisor) runs the same plan under another kernel.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

from uibus.agents import gvisor, network, seccomp
from uibus.agents.confinement import confinement, system_binds
from uibus.agents.launcher import SYSTEM, TMP, Launch, private_dirs, under


def git_common_dir(cwd: str | None) -> str:
    """The repository's common .git directory when `cwd` is a git worktree whose .git lies outside
    it (a `git worktree add` checkout): git writes objects and refs there to commit. Asked once,
    at start-up, of the operator's configured cwd (blocking is fine then), never of a directory an
    agent has written since."""
    if not cwd or not Path(cwd, ".git").is_file() or shutil.which("git") is None:
        return ""
    try:
        done = subprocess.run(["git", "-C", cwd, "rev-parse", "--path-format=absolute", "--git-common-dir"],
                              capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    common = done.stdout.strip()
    return common if done.returncode == 0 and common and Path(common).is_dir() else ""




def bwrap_argv(launch: Launch, common_dir: str | None = None, seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line that runs `launch.argv` confined (see the module docstring).
    Order matters to bwrap: later mounts go on top of earlier ones, so the private /tmp comes
    before the working directory (which may lie under /tmp) and uibus's masks come last."""
    box = launch.sandbox
    assert box is not None
    args = [box.bwrap, *confinement(box.nested), "--hostname", "uibus-agent"]
    if seccomp_fd is not None:
        args.extend(["--seccomp", str(seccomp_fd)])
    args.extend(network.bwrap_args(box))  # a namespace of its own unless "host" (uibus.agents.network)
    bound: list[str] = []  # host trees visible inside

    def bind(kind: str, src: str, dest: str | None = None) -> None:
        args.extend([kind, src, dest or src])
        bound.append(src)

    args.extend(system_binds())
    bound.extend(p for p in SYSTEM if not os.path.islink(p) and os.path.exists(p))
    home, tenant_home = launch.home, launch.tenant_home()
    # /tmp: the tenant's own, kept (caches such as jiti's compiled TypeScript, which pi's extensions
    # would otherwise pay at every start: measured +200 ms), or a fresh tmpfs without a tenant home
    tmp = ["--bind", os.path.join(tenant_home, TMP), "/tmp"] if tenant_home is not None else ["--tmpfs", "/tmp"]
    args.extend(["--proc", "/proc", "--dev", "/dev", *tmp, "--tmpfs", "/var/tmp"])
    shown: list[tuple[str, str]] = []  # (host path, where it shows) of the read-only installations
    for path in box.read_only:
        real = os.path.realpath(path)
        if os.path.exists(real):
            shown.append((real, real))
            if real != os.path.abspath(path):  # reachable by the name it is configured as, too
                shown.append((real, os.path.abspath(path)))
    # an installation under HOME (nvm, pyenv, ~/.local/bin) goes on top of the tenant's home, which
    # would hide it otherwise; the rest before it
    over_home = [(src, dest) for src, dest in shown if tenant_home is not None and home and under(dest, home)]
    for src, dest in shown:
        if (src, dest) not in over_home:
            bind("--ro-bind", src, dest)
    if tenant_home is not None:
        bind("--bind", tenant_home, home)
        for name in box.home_files:
            src = os.path.join(home, name)
            if os.path.exists(src):
                bind("--ro-bind", src)
    for src, dest in over_home:
        bind("--ro-bind", src, dest)
    if launch.cwd:
        bind("--bind", launch.cwd)
        if common_dir and not under(common_dir, launch.cwd):
            bind("--ro-bind", common_dir)
            args.extend(_git_writable(launch.cwd, common_dir))
    for path in box.hide:  # uibus's own files, wherever a bind above would show them
        if not os.path.lexists(path) or not any(under(path, b) for b in bound):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            args.extend(["--tmpfs", path])
        else:
            args.extend(["--ro-bind", "/dev/null", path])
    if launch.cwd:
        args.extend(["--chdir", launch.cwd])
    return [*args, "--", *launch.argv]


def _git_writable(cwd: str, common: str) -> list[str]:
    """bwrap arguments making writable, in a git worktree's repository shown read-only, what
    committing needs: objects, refs, logs and the worktree's own admin folder (HEAD, index) —
    but not its pointers (`commondir`, `gitdir`), nor this worktree's `.git` link, nor the
    repository's config, hooks, info or the other worktrees. Why: uibus itself runs git in the
    worktree and the repository (summary, diff, `git add` in a private index, `worktree add`); an
    agent that could plant a `core.fsmonitor`, a filter, a hook, a `commondir` or a `gitdir:` to a
    repository of its own would run code as uibus, outside its sandbox."""
    out: list[str] = []
    for name in ("objects", "refs", "logs"):
        path = os.path.join(common, name)
        if name == "logs":
            os.makedirs(path, exist_ok=True)  # git makes it at a first reflog: not in a read-only root
        if os.path.isdir(path):
            out.extend(["--bind", path, path])
    link = os.path.join(cwd, ".git")
    try:
        with open(link, encoding="utf-8") as f:
            own = f.read(4096).strip().removeprefix("gitdir:").strip()
    except OSError:
        own = ""
    if own and under(os.path.realpath(own), os.path.realpath(os.path.join(common, "worktrees"))) \
            and os.path.isdir(own):
        out.extend(["--bind", own, own])
        for name in ("commondir", "gitdir", "config.worktree"):
            path = os.path.join(own, name)
            if os.path.lexists(path):
                out.extend(["--ro-bind", path, path])
    out.extend(["--ro-bind", link, link])
    return out


def installation_of(program: str, path: str) -> list[str]:
    """Where an agent program lives, to be shown read-only in its sandbox: its package folder (the
    outermost `node_modules` on its way, or the prefix above its `bin`), by the name configured and
    by its real name, and likewise for the interpreter its `#!` line names (node, python)."""
    found: list[str] = []
    for p in (program, os.path.realpath(program)):
        found.append(_root(p))
    interpreter = _shebang(os.path.realpath(program), path)
    if interpreter:
        for p in (interpreter, os.path.realpath(interpreter)):
            found.append(_root(p))
    return list(dict.fromkeys(f for f in found if f not in ("/", "") and not any(under(f, s) for s in SYSTEM)))


def _root(path: str) -> str:
    parts = Path(path).parts
    if "node_modules" in parts:
        return str(Path(*parts[:parts.index("node_modules") + 1]))
    parent = Path(path).parent
    return str(parent.parent if parent.name == "bin" else parent)


def _shebang(program: str, path: str) -> str | None:
    try:
        with open(program, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env":
        rest = [w for w in words[1:] if not w.startswith("-")]
        return shutil.which(rest[0], path=path) if rest else None
    return words[0]


def program_problem(launch: Launch) -> str:
    """Why `launch`'s program cannot start inside its sandbox ("" when it can): run at start-up,
    confined exactly as the agent will be, it checks that the program and the interpreter its `#!`
    line names are there and executable — so an installation the sandbox does not show fails
    `uibus serve` naming the option, not the user's first turn with "the process exited"."""
    box = launch.sandbox
    assert box is not None
    program = launch.argv[0]
    wanted = [program, *([i] if (i := _shebang(os.path.realpath(program), launch.env.get("PATH", ""))) else [])]
    home = launch.tenant_home()
    if home is not None:
        private_dirs(home, os.path.join(home, TMP))
    check = 'for p do [ -x "$p" ] || { echo "$p"; exit 3; }; done'
    probe = replace(launch, argv=("/bin/sh", "-c", check, "probe", *wanted))
    fd = seccomp.memfd(box.nested)
    try:
        with contextlib.ExitStack() as kernel:
            argv = bwrap_argv(probe, box.git_common or None, None if box.runsc else fd)
            if box.runsc:
                argv = kernel.enter_context(gvisor.bundle(box.runsc, argv, launch.env))
            done = subprocess.run(argv, capture_output=True, timeout=30, check=False, pass_fds=(fd,), cwd=launch.cwd,
                                  env=launch.env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the sandbox could not be tried: {exc}"
    finally:
        os.close(fd)
    if done.returncode == 3:
        return f"{done.stdout.decode(errors='replace').strip()} is not there (or not executable) inside the sandbox"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return f"the sandbox failed: {why[-1] if why else f'exit code {done.returncode}'}"
    return ""


def sandbox_problem(bwrap: str, nested: bool = False) -> str:
    """Why a sandbox cannot start here ("" when it can): bwrap missing, or it fails to make its
    namespaces (no user namespaces for an unprivileged uibus, a seccomp profile forbidding them),
    or a process inside would keep a capability or run without the seccomp filter — checked by
    running one, confined exactly as agents are, and reading its /proc/self/status."""
    if not os.access(bwrap, os.X_OK):
        return f"{bwrap} is not an executable file (install bubblewrap, or set option bwrap)"
    try:
        fd = seccomp.memfd(nested)
    except seccomp.SeccompUnavailable as exc:
        return str(exc)
    try:
        done = subprocess.run([bwrap, *confinement(nested), "--seccomp", str(fd), "--ro-bind", "/", "/",
                               "--proc", "/proc", "--dev", "/dev", "--", "/bin/cat", "/proc/self/status"],
                              capture_output=True, timeout=10, check=False, pass_fds=(fd,))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} cannot run: {exc}"
    finally:
        os.close(fd)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return f"{bwrap} cannot make a sandbox here: {why[-1] if why else f'exit code {done.returncode}'}"
    status = dict(line.split(":", 1) for line in done.stdout.decode(errors="replace").splitlines() if ":" in line)
    kept = [k for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if int(status.get(k, "1").strip(), 16)]
    if kept:
        return (f"an agent would keep capabilities inside ({', '.join(f'{k} {status[k].strip()}' for k in kept)}): "
                f"{bwrap} does not drop them here (bubblewrap 0.8 or newer drops them with --cap-drop ALL)")
    if status.get("Seccomp", "").strip() != "2":
        return f"an agent would run without its seccomp filter ({bwrap} did not load it)"
    return ""
