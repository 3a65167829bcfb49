"""The process a python grader's code runs in: started by `python_grader.run_python`
as `python -I -B <this file>`, with a clean environment (no token, no store URL) in an
empty temporary directory. Before the caller's code is even compiled it is limited:

- CPU seconds and address space (RLIMIT_CPU, RLIMIT_AS), open files and file size;
- files: Landlock (Linux 5.13+, no privilege needed) lets it read only the Python it runs
  on (its prefixes) and the system's shared libraries, and write only its own temporary
  directory: not the data directory, not the store, not other tenants' files. Where the
  kernel has no Landlock the run fails rather than run unconfined;
- no network, no other programs, no other processes: a seccomp filter (libseccomp,
  through `pyseccomp`) makes socket(2) and its kin, execve(2), fork(2) and a clone(2) that
  is not a thread's fail with EPERM (clone3(2), whose flags a filter cannot read, fails
  with ENOSYS, so the C library falls back to clone for threads). It needs no privilege,
  as a network namespace would.

Its input (stdin): {"source", "pairs": [[sample, item], ...], "cpu_s", "memory_bytes"}.
Its output (the original stdout, after the run): one JSON list, a {"score"} or {"error"}
per pair. The caller's own prints go to stderr."""

from __future__ import annotations

import errno
import json
import os
import resource
import sys

DENIED = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "sendto", "sendmsg", "sendmmsg", "execve", "execveat", "fork", "vfork",
)  # fmt: skip
CLONE_THREAD = 0x00010000  # linux/sched.h


# Landlock's ABI (linux/landlock.h): syscalls, rule type, and filesystem access rights
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_RULESET_VERSION = 1  # landlock_create_ruleset flag: ask for the ABI version
_PATH_BENEATH = 1
_EXECUTE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 2, 1 << 3
_PR_SET_NO_NEW_PRIVS = 38
READ_ONLY_SYSTEM = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo")


def _fs_rights(abi: int) -> int:
    """Every filesystem right this ABI knows: all of them are handled (denied unless a
    rule allows)."""
    rights = (1 << 13) - 1  # ABI 1: execute ... make_sym
    if abi >= 2:
        rights |= 1 << 13  # refer
    if abi >= 3:
        rights |= 1 << 14  # truncate
    if abi >= 5:
        rights |= 1 << 15  # ioctl_dev
    return rights


def restrict_files(read_only: list[str], writable: str) -> None:
    """Landlock: from here on this process (and any child) reads only under `read_only`
    and reads and writes only under `writable`."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), _RULESET_VERSION)
    if abi < 1:
        raise SystemExit(
            "python graders cannot be confined here: this kernel has no Landlock (Linux "
            "5.13 or newer, with landlock among its LSMs)"
        )
    handled = _fs_rights(abi)
    attr = ctypes.c_uint64(handled)  # landlock_ruleset_attr's first field is all ABI 1 needs
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), 0)
    if ruleset < 0:
        raise SystemExit(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    allowed = [(p, _EXECUTE | _READ_FILE | _READ_DIR) for p in read_only] + [(writable, handled)]
    for path, access in allowed:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a system directory this machine lacks
        rule = PathBeneath(access, fd)
        rc = libc.syscall(_ADD_RULE, ruleset, _PATH_BENEATH, ctypes.byref(rule), 0)
        os.close(fd)
        if rc < 0:
            raise SystemExit(f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}")
    if (
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.syscall(_RESTRICT_SELF, ruleset, 0) != 0
    ):
        raise SystemExit(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}")
    os.close(ruleset)


def confine(cpu_s: int, memory_bytes: int) -> None:
    import pyseccomp as seccomp  # loads libseccomp (found through /etc) before files close

    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    restrict_files(sorted(prefixes) + list(READ_ONLY_SYSTEM), os.getcwd())
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    not_a_thread = seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0)
    rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", not_a_thread)
    rules.load()


def main() -> None:
    job = json.load(sys.stdin)
    results = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # the caller's prints never mix into the results
    confine(int(job["cpu_s"]), int(job["memory_bytes"]))
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
            out.append({"error": f"{type(e).__name__}: {e}"})
    results.write(json.dumps(out))
    results.flush()


if __name__ == "__main__":
    main()
