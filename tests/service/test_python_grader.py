"""Python graders run the tenant's `grade(sample, item)` in a sandboxed process
(service/methods/python_grader.py, python_sandbox.py): each test names one thing the code
must not do, or one limit, and checks it is stopped with the reason as the score's error."""

from __future__ import annotations

import ctypes
import time

import pytest

from service.errors import InvalidRequest
from service.methods.graders import Runners, grade, grade_all, parse_grader
from service.methods.python_grader import SandboxLimits, run_python


def _landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(444, None, ctypes.c_size_t(0), 1)


pytestmark = pytest.mark.skipif(
    _landlock_abi() < 1,
    reason="this kernel has no Landlock, so python graders refuse to run (tested below "
    "only where they can)",
)
LIMITS = SandboxLimits(cpu_s=1, memory_bytes=512 << 20, wall_s=4)
PAIR = ({"output_text": "Paris", "output_json": None}, {"answer": "Paris"})


def one(source: str, limits: SandboxLimits = LIMITS):
    (got,) = run_python(source, [PAIR], limits)
    return got


def test_grade_scores_each_pair_and_one_pairs_error_spares_the_others():
    source = """
def grade(sample, item):
    if item["answer"] == "boom":
        raise ValueError("no such city")
    return 1.0 if sample["output_text"] == item["answer"] else 0.0
"""
    pairs = [PAIR, (PAIR[0], {"answer": "Lyon"}), (PAIR[0], {"answer": "boom"})]
    got = run_python(source, pairs, LIMITS)
    assert [g.score for g in got] == [1.0, 0.0, 0.0]
    assert [g.error for g in got] == [None, None, "ValueError: no such city"]


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('127.0.0.1', 9))",
        "import socket; socket.socket(socket.AF_UNIX)",
        "import subprocess; subprocess.run(['true'])",
        "import os; os.fork()",
        "import multiprocessing as m; p = m.Process(target=print); p.start()",
    ],
    ids=["tcp", "unix-socket", "program", "fork", "multiprocessing"],
)
def test_no_network_no_programs_no_processes(code):
    got = one(f"def grade(sample, item):\n    {code}\n    return 1.0")
    assert got.score == 0.0
    assert got.error.startswith("PermissionError"), got.error


def test_it_reads_no_file_outside_python_and_creates_none(tmp_path):
    secret = tmp_path / "store.db"
    secret.write_text("other tenants' data")
    for code in (
        f"len(open({str(secret)!r}).read())",
        "len(open('/etc/passwd').read())",
        "open('x', 'w').write('abc')",
        "__import__('os').mkdir('d')",
    ):
        got = one(f"def grade(s, i):\n    return {code}")
        assert got.error.startswith("PermissionError"), (code, got.error)
    stdlib = "import statistics\ndef grade(s, i):\n    return statistics.mean([1, 2])"
    assert one(stdlib).score == 1.5


def test_it_cannot_touch_other_processes_or_share_memory_with_them():
    import subprocess

    other = subprocess.Popen(["sleep", "30"])
    try:
        for code in (
            f"__import__('os').kill({other.pid}, 9)",
            "__import__('os').kill(__import__('os').getppid(), 0)",
            f"__import__('resource').prlimit({other.pid}, 7, (3, 3))",
            f"__import__('os').sched_setaffinity({other.pid}, {{0}})",
            f"__import__('os').setpriority(0, {other.pid}, 19)",
        ):
            got = one(f"def grade(s, i):\n    {code}\n    return 1.0")
            assert got.error.startswith("PermissionError"), (code, got.error)
        assert other.poll() is None  # still running, untouched
    finally:
        other.kill()
        other.wait()
    # io_uring (its socket operations would pass the socket rules) and System V memory
    for call in ("syscall(425, 8, ctypes.create_string_buffer(120))", "shmget(1234, 4096, 0o1666)"):
        source = (
            "import ctypes\ndef grade(s, i):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
            f"    if libc.{call} < 0:\n        raise OSError(ctypes.get_errno(), 'refused')\n"
            "    return 1.0"
        )
        assert one(source).error == "PermissionError: [Errno 1] refused", call


def test_it_changes_no_files_metadata_and_starts_no_thread(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("data")
    before = victim.stat()
    path = repr(str(victim))
    for code in (
        f"__import__('os').chmod({path}, 0)",
        f"__import__('os').chown({path}, 0, 0)",
        f"__import__('os').utime({path}, (0, 0))",
        f"__import__('os').truncate({path}, 0)",
        f"__import__('os').setxattr({path}, 'user.x', b'1')",
        "__import__('os').posix_fallocate(1, 0, 1 << 30)",
        "1 / (__import__('ctypes').CDLL(None).inotify_init1(0) >= 0) and None",
        "__import__('threading').Thread(target=print).start()",
    ):
        got = one(f"def grade(s, i):\n    {code}\n    return 1.0")
        assert got.score == 0.0, (code, got)
    after = victim.stat()
    assert (after.st_mode, after.st_mtime, after.st_size) == (
        before.st_mode,
        before.st_mtime,
        before.st_size,
    )


def test_no_other_process_can_be_made_the_target_of_sigio():
    source = (
        "import fcntl, os\ndef grade(s, i):\n    r, w = os.pipe()\n"
        "    fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())\n    return 1.0"
    )
    assert one(source).error == "PermissionError: [Errno 1] Operation not permitted"


def test_what_the_graders_code_writes_or_raises_never_passes_for_a_server_error():
    fake = one("import sys\ndef grade(s, i):\n    print('sandbox: broken', file=sys.stderr)\n"
               "    sys.stderr.flush()\n    __import__('os')._exit(3)")  # fmt: skip
    assert (fake.kind, fake.error) == ("runtime", "sandbox: broken")
    junk = one("import os\ndef grade(s, i):\n    os.write(1, b'[{\"x\": 1}]')\n    os._exit(0)")
    assert (junk.kind, junk.score) == ("runtime", 0.0)
    surrogate = one("def grade(s, i):\n    raise ValueError(chr(0xD800))")
    surrogate.error.encode("utf-8")  # printable: the API can send it


def test_its_output_is_bounded_and_any_bytes_of_it_are_read():
    flood = one("import sys\ndef grade(s, i):\n    sys.stderr.write('x' * (8 << 20))")
    assert flood.error == "OSError: [Errno 27] File too large"
    raw = one("import os\ndef grade(s, i):\n    os.write(2, b'\\xff')\n    raise ValueError('x')")
    assert raw.error == "ValueError: x"
    nan = one("def grade(s, i):\n    return float('nan')")
    assert (nan.score, nan.error) == (0.0, "the grader returned nan, not a finite number")


def test_it_sees_none_of_the_servers_environment(monkeypatch):
    monkeypatch.setenv("PSTAR_API_TOKENS", "acme:secret")
    got = one("import os\ndef grade(s, i):\n    return 'PSTAR_API_TOKENS' in os.environ")
    assert (got.score, got.error) == (0.0, None)


def test_cpu_memory_and_wall_time_are_limited():
    t0 = time.monotonic()
    spin = one("def grade(s, i):\n    while True: pass")
    assert spin.error == "the grader used more than its 1 s of CPU"
    sleep = one("import time\ndef grade(s, i):\n    time.sleep(60)")
    assert sleep.error == "the grader ran past its 4 s and was stopped"
    assert time.monotonic() - t0 < 20
    hog = one("def grade(s, i):\n    return len(bytearray(1 << 30))")
    assert hog.error.startswith("MemoryError")


def test_the_callers_prints_do_not_spoil_the_scores():
    assert one("def grade(s, i):\n    print('0.9')\n    return 0.25").score == 0.25


def test_a_python_grader_is_a_400_while_off_and_its_source_is_checked_when_on():
    raw = {"type": "python", "name": "p", "source": "def grade(s, i): return 1"}
    with pytest.raises(InvalidRequest, match="PSTAR_PYTHON_GRADERS=on") as e:
        parse_grader(raw)
    assert e.value.param == "grader.type"
    with pytest.raises(InvalidRequest, match="not Python") as e:
        parse_grader({**raw, "source": "def grade(:"}, python=True)
    assert e.value.param == "grader.source"
    with pytest.raises(InvalidRequest, match="no function grade"):
        parse_grader({**raw, "source": "def score(s, i): return 1"}, python=True)
    multi = {"type": "multi", "name": "m", "graders": {"p": raw}, "calculate_output": "p / 2"}
    got = grade(parse_grader(multi, python=True), "x", {}, Runners(limits=LIMITS))
    assert (got.reward, got.sub_rewards, got.python_error) == (0.5, {"p": 1.0}, None)


def test_grading_a_batch_runs_each_python_grader_once_and_scores_as_one_by_one(monkeypatch):
    import service.methods.graders as graders

    runs = []
    real = graders.run_python

    def counted(source, pairs, limits=None):
        runs.append(len(pairs))
        return real(source, pairs, limits)

    monkeypatch.setattr(graders, "run_python", counted)
    source = """
def grade(sample, item):
    if item["answer"] == "boom":
        raise ValueError("no such city")
    got = sample["output_json"]
    return 0.5 if got is None else float(got.get("city") == item["answer"])
"""
    check = {"type": "string_check", "name": "s", "operation": "ilike",
             "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}  # fmt: skip
    multi = {
        "type": "multi", "name": "m", "calculate_output": "p + s",
        "graders": {"p": {"type": "python", "name": "p", "source": source}, "s": check},
    }  # fmt: skip
    grader = parse_grader(multi, python=True)
    samples = ['{"city": "Paris"}', "Paris", '{"city": "Lyon"}', "boom"]
    items = [{"answer": "Paris"}, {"answer": "Paris"}, {"answer": "Paris"}, {"answer": "boom"}]
    batch = grade_all(grader, samples, items, Runners(limits=LIMITS))
    assert runs == [4]  # one sandbox for the four answers
    runs.clear()
    alone = [
        grade(grader, s, it, Runners(limits=LIMITS)) for s, it in zip(samples, items, strict=True)
    ]
    assert runs == [1, 1, 1, 1]
    assert [g.reward for g in batch] == [g.reward for g in alone] == [2.0, 1.5, 0.0, 1.0]
    assert [g.python_error for g in batch] == [g.python_error for g in alone]
    assert batch[3].python_error == "ValueError: no such city"


def test_an_answer_that_breaks_the_limits_in_a_batch_zeroes_only_itself():
    source = """
def grade(sample, item):
    if sample["output_text"] == "spin":
        while True:
            pass
    return 1.0
"""
    grader = parse_grader({"type": "python", "name": "p", "source": source}, python=True)
    got = grade_all(grader, ["a", "spin", "b"], [{}, {}, {}], Runners(limits=LIMITS))
    assert [g.reward for g in got] == [1.0, 0.0, 1.0]
    assert got[1].python_error is not None
    assert got[0].python_error is None
