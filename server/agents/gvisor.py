"""A kernel boundary as a second sandbox (option `sandbox = "gvisor"`): the agent runs under
gVisor's `runsc`, whose Sentry answers its system calls in user space, so a kernel bug reachable
from inside is gVisor's, not the host's.

Why translate bubblewrap's plan rather than write a second one: what an agent sees — the system
read-only with its secrets masked, its installation, its tenant's home at HOME, its workspace,
uibus's own files hidden, its /tmp — is decided once, by `bwrap_argv` (uibus.agents.bubblewrap),
and both backends must give the same guarantees. So this module reads that argument list (binds,
links, tmpfs mounts, the working directory, the user) and writes it as an OCI bundle's
`config.json` for `runsc run`: the same view, another kernel. What bwrap adds that gVisor does
not need is dropped (its seccomp filter and namespace flags: the Sentry is the boundary; no
capability is granted; the network is always none: gVisor's own network stack needs privileges
uibus does not assume).

Each launch gets a bundle folder of its own (uibus's, never shown to the agent) and a container
named after it; when the launch ends the container is deleted (`runsc delete -force`) and the
folder removed. `runsc --rootless --ignore-cgroups`: no privilege asked of the host (the agent's
cgroup limits, uibus.agents.limits, hold runsc and everything it starts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

KERNEL = "gvisor"
_FLAGS = {"--unshare-user", "--disable-userns", "--die-with-parent", "--unshare-pid", "--unshare-ipc",
          "--unshare-uts", "--unshare-cgroup-try", "--unshare-net", "--unshare-all", "--new-session"}
_ONE = {"--cap-drop", "--seccomp", "--hostname", "--uid", "--gid", "--chdir", "--remount-ro"}
_TWO = {"--bind", "--ro-bind", "--symlink"}


def spec(bwrap: Sequence[str], env: dict[str, str], rootfs: str, empty: str) -> dict[str, Any]:
    """The OCI runtime spec of what `bwrap` (an argument list from `bwrap_argv`, program first)
    would run, as gVisor runs it; `rootfs`: an empty folder whose links the caller made
    (`links`); `empty`: an empty read-only file, shown where bwrap masks a file with /dev/null
    (gVisor's gofer serves files and folders, not the host's devices)."""
    args = list(bwrap[1:])
    mounts: list[dict[str, Any]] = []
    # root of the Sentry's own user namespace, which owns nothing of the host's (no capability is
    # granted; rootless runsc maps it onto uibus's user): bwrap's --uid/--gid do not carry over
    cwd, uid, gid, hostname = "/", 0, 0, "uibus-agent"
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            argv = args[i + 1:]
            break
        if a in _FLAGS:
            i += 1
            continue
        if a in _ONE:
            value = args[i + 1]
            if a == "--chdir":
                cwd = value
            elif a == "--hostname":
                hostname = value
            elif a == "--remount-ro":
                for m in reversed(mounts):
                    if m["destination"] == value:
                        m["options"] = [*m.get("options", []), "ro"]
                        break
            i += 2
            continue
        if a in _TWO:
            src, dest = args[i + 1], args[i + 2]
            if a != "--symlink":
                mounts.append({"destination": dest, "type": "bind", "source": empty if src == "/dev/null" else src,
                               "options": ["rbind", "ro" if a == "--ro-bind" else "rw"]})
            i += 3
            continue
        if a == "--tmpfs":
            mounts.append({"destination": args[i + 1], "type": "tmpfs", "source": "tmpfs",
                           "options": ["nosuid", "nodev", "mode=1777"]})
        elif a == "--proc":
            mounts.append({"destination": args[i + 1], "type": "proc", "source": "proc"})
        elif a == "--dev":
            pass  # gVisor's own /dev (null, zero, random, tty…), as bwrap makes its own
        else:
            raise ValueError(f"gVisor cannot carry bwrap's {a}")
        i += 2
    else:
        raise ValueError("no command after --")
    none: dict[str, list[str]] = {k: [] for k in ("bounding", "effective", "permitted", "inheritable", "ambient")}
    return {
        "ociVersion": "1.0.0",
        "process": {"terminal": False, "user": {"uid": uid, "gid": gid}, "args": argv, "cwd": cwd,
                    "env": [f"{k}={v}" for k, v in env.items()], "capabilities": none, "noNewPrivileges": True},
        "root": {"path": rootfs, "readonly": True},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }


def links(bwrap: Sequence[str]) -> list[tuple[str, str]]:
    """bwrap's `--symlink TARGET PATH` pairs (a merged /usr's /bin -> usr/bin): made in the rootfs."""
    out, args = [], list(bwrap)
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == "--symlink":
            out.append((args[i + 1], args[i + 2]))
    return out


@contextlib.contextmanager
def bundle(runsc: str, bwrap: Sequence[str], env: dict[str, str]) -> Iterator[list[str]]:
    """A bundle for one launch, and the command that runs it; the container and the folder go
    when the block ends (blocking: call it from a thread, or accept a few ms)."""
    folder = Path(tempfile.mkdtemp(prefix="uibus-gvisor-"))
    name = f"uibus-{uuid.uuid4().hex[:16]}"
    try:
        rootfs = folder / "rootfs"
        rootfs.mkdir(mode=0o755)
        for target, path in links(bwrap):
            place = rootfs / path.lstrip("/")
            place.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, place)
        empty = folder / "empty"
        empty.touch(mode=0o444)
        plan = spec(bwrap, env, str(rootfs), str(empty))
        _mount_points(rootfs, plan["mounts"])
        (folder / "config.json").write_text(json.dumps(plan))
        yield [runsc, "--rootless", "--network=none", "--ignore-cgroups", "--root", str(folder / "state"),
               "run", "--bundle", str(folder), name]
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([runsc, "--root", str(folder / "state"), "delete", "-force", name], capture_output=True,
                           timeout=10, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def _mount_points(rootfs: Path, mounts: list[dict[str, Any]]) -> None:
    """Each mount's destination made in the (read-only) rootfs where no earlier mount covers it:
    gVisor mounts onto what exists, as bwrap makes its own mount points."""
    covered: list[str] = []
    for m in mounts:
        dest = m["destination"]
        if not any(dest == c or dest.startswith(c.rstrip("/") + "/") for c in covered):
            place = rootfs / dest.lstrip("/")
            if m["type"] == "bind" and os.path.isfile(m["source"]):
                place.parent.mkdir(parents=True, exist_ok=True)
                place.touch()
            else:
                place.mkdir(parents=True, exist_ok=True)
        covered.append(dest)


def problem(runsc: str) -> str:
    """Why gVisor cannot run an agent here ("" when it can): runsc missing, or a container of
    `/bin/true` failing (no user namespaces, an old runsc)."""
    found = runsc if os.sep in runsc else (shutil.which(runsc) or runsc)
    if not os.access(found, os.X_OK):
        return f"{runsc} is not an executable file (install Debian's runsc, or set option runsc)"
    probe = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
             "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--", "/bin/true"]
    with bundle(found, probe, {"PATH": "/usr/bin:/bin"}) as argv:
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{runsc} cannot run: {exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        return f"{runsc} cannot make a sandbox here: {why[-1] if why else f'exit code {done.returncode}'}"
    return ""
