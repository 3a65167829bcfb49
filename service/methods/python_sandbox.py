"""The process a python grader's code runs in: started by `python_grader.run_python`
as `python -I -B <this file>`, with a clean environment (no token, no store URL), in an
empty temporary directory, its stdout and stderr going to files there. Before the
caller's code is even compiled it is confined, in this order:

- limits: CPU seconds and address space (RLIMIT_CPU, RLIMIT_AS), 1 MiB per file written
  (RLIMIT_FSIZE: stdout and stderr are files), 32 open files, no core dumps;
- capabilities: every one dropped (the server may run as root in a container). The user
  stays the server's: its Python may be readable by it alone (pyenv under /root); what
  an owner could still do to its own files (modes, owners, times, attributes) is denied
  below;
- files (Landlock, Linux 5.13+, no privilege needed): it may read the Python it runs on
  (its prefixes) and the system's shared libraries, and open nothing else: not the data
  directory, not the store, not other tenants' files; it can create no file anywhere (it
  writes only to the stdout and stderr it was given). Where the kernel's Landlock is
  recent enough, TCP (ABI 4), signals to processes outside the sandbox and abstract UNIX
  sockets (ABI 6) are closed too. Where the kernel has no Landlock the run fails, as a
  server error, rather than run unconfined;
- system calls (seccomp, through `pyseccomp`, libseccomp's bindings): `DENIED` fail with
  EPERM: sockets, programs, processes, io_uring (whose operations would bypass the socket
  rules), System V IPC, namespaces, mounts, tracing and the like. Signals, resource limits
  and scheduling may target this process only, named by its pid; no process or thread
  can be started (clone, clone3, fork); nothing may ask for another process to be
  signalled (F_SETOWN, F_SETSIG, FIOSETOWN); file modes, owners, times, attributes and
  sizes cannot be changed, and no space preallocated.

Its input (stdin): {"source", "pairs": [[sample, item], ...], "cpu_s", "memory_bytes"}.
Its output (stdout, once graded): one JSON list, a {"score"} or {"error"} per pair. The
caller's own prints go to stderr. Once confined, and before the caller's code runs, it
writes a mark to the file descriptor the input names ("confined_fd"): a run that ends
without the mark failed in the sandbox (a server error), one that ends after it, in the
caller's code."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import sys

SANDBOX = "sandbox:"  # the prefix of the sandbox's own failures on stderr
DENIED = (
    # network
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "sendto", "sendmsg", "sendmmsg",
    # programs and processes
    "execve", "execveat", "fork", "vfork",
    "tkill", "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "setpriority", "ioprio_set",
    # io_uring runs socket and file operations in the kernel, past these rules
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # System V IPC: memory and queues shared with other processes of the user
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink",
    # file metadata and space, which Landlock does not cover: modes, owners, times,
    # extended attributes (ACLs), truncation (Landlock's before ABI 3), preallocation
    "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "utimensat", "futimesat", "setxattr", "lsetxattr", "fsetxattr",
    "removexattr", "lremovexattr", "fremovexattr", "truncate", "ftruncate", "fallocate",
    # watching other directories' files come and go
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_mark",
    # threads too: each is a process of the machine's (pids are a shared resource)
    "clone",
    # namespaces, mounts, the kernel's own objects
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_by_handle_at",
    "name_to_handle_at", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "fanotify_init", "init_module", "finit_module", "delete_module",
    "kexec_load", "reboot", "swapon", "swapoff", "acct", "quotactl",
)  # fmt: skip
# calls whose first argument is a process: allowed when it names this one by its pid
# (libseccomp compares an argument once a rule, so "0: the caller" is refused too; the
# limits are set before the filter is loaded)
OWN_PID_ONLY = (
    "kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64",
    "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
)  # fmt: skip
# newer calls libseccomp 2.5 cannot name, by number (the same on every architecture)
DENIED_NUMBERS = {452: "fchmodat2", 463: "setxattrat", 466: "removexattrat"}
# fcntl and ioctl commands that would make the kernel signal another process (SIGIO)
FCNTL_F_SETOWN, FCNTL_F_SETSIG, FCNTL_F_SETOWN_EX = 8, 10, 15
IOCTL_FIOSETOWN, IOCTL_SIOCSPGRP = 0x8901, 0x8902

# Landlock's ABI (linux/landlock.h): syscalls, rule type, access rights and scopes
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_RULESET_VERSION = 1  # landlock_create_ruleset flag: ask for the ABI version
_PATH_BENEATH = 1
_EXECUTE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 2, 1 << 3
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_PR_SET_NO_NEW_PRIVS = 38
READ_ONLY_SYSTEM = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo")


def _fs_rights(abi: int) -> int:
    """Every filesystem right this ABI knows: all are handled (denied unless a rule
    allows)."""
    rights = (1 << 13) - 1  # ABI 1: execute ... make_sym
    if abi >= 2:
        rights |= 1 << 13  # refer
    if abi >= 3:
        rights |= 1 << 14  # truncate
    if abi >= 5:
        rights |= 1 << 15  # ioctl_dev
    return rights


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _fail(why: str) -> None:
    raise SystemExit(f"{SANDBOX} {why}")


def restrict_files(read_only: list[str]) -> None:
    """Landlock: from here on this process reads only under `read_only`, opens nothing
    for writing, and (where the ABI has them) uses no TCP and signals no process outside."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), _RULESET_VERSION)
    if abi < 1:
        _fail(
            "python graders cannot be confined here: this kernel has no Landlock (Linux "
            "5.13 or newer, with landlock among its LSMs)"
        )
    attr = _RulesetAttr(_fs_rights(abi), 0, 0)
    size = 8
    if abi >= 4:
        attr.handled_access_net, size = _NET_BIND_TCP | _NET_CONNECT_TCP, 16
    if abi >= 6:
        attr.scoped, size = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL, 24
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        _fail(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}")
    for path in read_only:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a system directory this machine lacks
        rule = _PathBeneath(_EXECUTE | _READ_FILE | _READ_DIR, fd)
        rc = libc.syscall(_ADD_RULE, ruleset, _PATH_BENEATH, ctypes.byref(rule), 0)
        os.close(fd)
        if rc < 0:
            _fail(f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail(f"no_new_privs failed: {os.strerror(ctypes.get_errno())}")
    if libc.syscall(_RESTRICT_SELF, ruleset, 0) != 0:
        _fail(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}")
    os.close(ruleset)


def drop_capabilities() -> None:
    """No capability left, effective, permitted or inheritable (capset(2), version 3)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        _fail(f"capset failed: {os.strerror(ctypes.get_errno())}")


def confine(cpu_s: int, memory_bytes: int) -> None:
    import pyseccomp as seccomp  # loads libseccomp (found through /etc) before files close

    pid = os.getpid()
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        rules.add_rule(deny, name)
    for name in OWN_PID_ONLY:
        rules.add_rule(deny, name, seccomp.Arg(0, seccomp.NE, pid))
    for number in DENIED_NUMBERS:
        rules.add_rule(deny, number)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for command in (FCNTL_F_SETOWN, FCNTL_F_SETSIG, FCNTL_F_SETOWN_EX):
        rules.add_rule(deny, "fcntl", seccomp.Arg(1, seccomp.EQ, command))
    for command in (IOCTL_FIOSETOWN, IOCTL_SIOCSPGRP):
        rules.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.EQ, command))

    for limit, value in (
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_FSIZE, 1 << 20),
        (resource.RLIMIT_NOFILE, 32),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    restrict_files(sorted(prefixes) + list(READ_ONLY_SYSTEM))
    drop_capabilities()
    rules.load()


def main() -> None:
    job = json.load(sys.stdin)
    results = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # the caller's prints never mix into the results
    try:
        confine(int(job["cpu_s"]), int(job["memory_bytes"]))
    except SystemExit:
        raise
    except BaseException as e:  # a confinement that failed is the server's, not the code's
        _fail(f"{type(e).__name__}: {e}")
    # the caller's code runs from here: the parent tells its failures from the sandbox's by
    # this mark, which nothing that runs later can take back
    os.write(int(job["confined_fd"]), b"1")
    os.close(int(job["confined_fd"]))
    scope: dict = {"__name__": "grader"}
    exec(compile(job["source"], "<grader>", "exec"), scope)
    grade = scope.get("grade")
    if not callable(grade):
        raise SystemExit("the source defines no function grade(sample, item)")
    out: list[dict[str, float | str]] = []
    for sample, item in job["pairs"]:
        try:
            out.append({"score": float(grade(sample, item))})
        except Exception as e:  # one bad pair scores 0 with its error, the rest go on
            out.append({"error": f"{type(e).__name__}: {e}"[:500]})
    results.write(json.dumps(out))
    results.flush()


if __name__ == "__main__":
    main()
