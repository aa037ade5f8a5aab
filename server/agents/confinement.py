"""No privilege inside, whoever runs uibus: the bubblewrap arguments every box shares — a hosted
agent's sandbox (uibus.agents.bubblewrap), uibus's own git on a workspace (uibus.agents.gitbox),
the network probe (uibus.agents.network) — and the system they all see read-only.

Why one place: each box must drop exactly the same privileges; a second copy of this list would be
the one that forgets `--cap-drop ALL` (as the first sandbox did: started by root, its agents kept
`CapEff 000001fffeffffff`).
"""

from __future__ import annotations

import os

from uibus.agents.launcher import SYSTEM

# Files under /etc that hold the host's secrets: masked in every sandbox (a process that is root by
# uid, as uibus's agents are when uibus runs as root, owns them even without capabilities).
ETC_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/ssh", "/etc/ssl/private",
               "/etc/sudoers", "/etc/sudoers.d", "/etc/security/opasswd")


def confinement(nested: bool = False) -> list[str]:
    """bwrap's arguments that take every privilege away, whoever runs uibus: a user namespace of its
    own (root outside is root of nothing inside), every capability dropped (bounding set too), no
    new user namespaces from inside (`--disable-userns`; with `nested`, an agent that confines its
    own commands may make them, holding no capability over ours), new PID, IPC and UTS namespaces,
    and death with its parent. The seccomp filter comes with `--seccomp FD` (uibus.agents.seccomp)."""
    # uibus as root: the process is `nobody` inside (root outside still, owning nothing more): a
    # tool that takes uid 0 for power sees none, and bubblewrap inside (nested) makes its sandbox as
    # an unprivileged user would (as root it would try to map ids it may not)
    who = ["--uid", "65534", "--gid", "65534"] if os.getuid() == 0 else []
    return ["--unshare-user", *who, *([] if nested else ["--disable-userns"]), "--cap-drop", "ALL",
            "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]


def system_binds() -> list[str]:
    """The system, read-only (the top-level links of a merged /usr made again), its secrets masked."""
    args: list[str] = []
    for path in SYSTEM:
        if os.path.islink(path):
            args.extend(["--symlink", os.readlink(path), path])
        elif os.path.exists(path):
            args.extend(["--ro-bind", path, path])
    for path in ETC_SECRETS:
        if os.path.isdir(path) and not os.path.islink(path):
            args.extend(["--tmpfs", path, "--remount-ro", path])
        elif os.path.lexists(path):
            args.extend(["--ro-bind", "/dev/null", path])
    return args
