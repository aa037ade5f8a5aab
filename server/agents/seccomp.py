"""The system calls a sandboxed process may not make: a seccomp filter handed to bubblewrap
(`--seccomp FD`), for hosted agents and for uibus's own git inside a box (uibus.agents.gitbox).

Why a deny-list like Docker's default profile rather than an allow-list: agents run anything a
model asks for (compilers, package managers, test runners, browsers), so an allow-list would break
them one system call at a time; what is refused is what a process inside a container never needs
and what turns a bug into an escape: kernel modules, keyrings, BPF, perf events, reaching files by
handle (`open_by_handle_at` read the host's tokens file from a sandbox that kept capabilities),
mounts, pivoting, tracing other processes, new namespaces (unless `nested_sandbox`: an agent such
as codex, which confines its own commands with bubblewrap, needs user namespaces of its own),
pushing keystrokes into a terminal (TIOCSTI, TIOCLINUX), clock and swap changes. `clone3` answers
ENOSYS, since its flags lie behind a pointer a filter cannot read: the C library falls back to
`clone`, whose namespace flags are checked.

The filter is built with libseccomp (pyseccomp: ctypes over the system's library), which resolves
the names for this architecture and kills a process that switches to another ABI (x32, i386) to
dodge the numbers.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

# Refused with EPERM, as container runtimes refuse them by default (Docker's and Podman's profiles).
DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module",
    "finit_module", "get_kernel_syms", "init_module", "ioperm", "iopl", "kcmp", "kexec_file_load",
    "kexec_load", "keyctl", "lookup_dcookie", "name_to_handle_at", "nfsservctl", "open_by_handle_at",
    "perf_event_open", "process_vm_readv", "process_vm_writev", "ptrace", "query_module", "quotactl",
    "reboot", "request_key", "settimeofday", "stime", "swapoff", "swapon", "sysfs", "_sysctl",
    "uselib", "userfaultfd", "ustat", "vm86", "vm86old", "syslog", "fanotify_init",
)
# Namespaces and mounts: refused unless the agent sandboxes its own commands (option nested_sandbox),
# and then they act only on namespaces it made itself (it holds no capability over ours).
NAMESPACES = ("mount", "umount", "umount2", "pivot_root", "unshare", "setns", "fsopen", "fsmount",
              "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr")
# clone's flags for new namespaces: user, mount, UTS, IPC, PID, network, cgroup, time
CLONE_NEW = (0x10000000, 0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000, 0x02000000, 0x00000080)
TIOCSTI = 0x5412
TIOCLINUX = 0x541C


class SeccompUnavailable(RuntimeError):
    """libseccomp cannot be loaded here (the message says what to install)."""


@functools.cache
def program(nested: bool = False) -> bytes:
    """The filter as a BPF program (bwrap's `--seccomp` format), built once per kind."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as exc:  # pyseccomp loads libseccomp.so.2 at import
        raise SeccompUnavailable(f"libseccomp is not usable here ({exc}); install the pyseccomp package "
                                 "and the system's libseccomp2") from exc
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED if nested else (*DENIED, *NAMESPACES):
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a system call on this architecture (vm86 on x86_64, stime on aarch64…)
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    if not nested:
        for flag in CLONE_NEW:
            flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for request in (TIOCSTI, TIOCLINUX):
        flt.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as f:  # export_bpf writes to a real file descriptor
        flt.export_bpf(f)
        f.seek(0)
        return f.read()


def memfd(nested: bool = False) -> int:
    """A file descriptor holding the filter, at its start, for bwrap's `--seccomp FD` (inheritable:
    the caller hands it to bwrap and closes its own copy once bwrap has started)."""
    code = program(nested)
    fd = os.memfd_create("uibus-seccomp", 0)
    try:
        os.write(fd, code)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
