"""`pstar bench prep`'s parts that need no server: its file is valid chat data of the size
asked, and each process it follows is counted in the right group (the whole benchmark
starts `pstar serve` and prepares a job: run by hand, see the README)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.prep import MB, _group, write_chat_file
from service.data.datasets import check_file


def test_the_file_is_chat_examples_of_about_the_size_asked(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = write_chat_file(path, 2 * MB)
    assert 2 * MB <= path.stat().st_size < 2 * MB + 4096  # one line past it at most
    check = check_file(path)
    assert check.ok, check.summary()
    assert check.format == "chat"
    assert check.examples == lines


def test_processes_are_grouped_as_the_table_reports_them():
    def proc(pid, *cmd):
        return SimpleNamespace(pid=pid, info={"cmdline": list(cmd)})

    api = 10
    assert _group(proc(10, "python", "-m", "pstar", "serve"), api) == ("api", "api")
    assert _group(proc(11, "ray::prepare ftjob-1"), api) == ("task", "task")
    assert _group(proc(12, "python", "-m", "service.control.driver", "ftjob-1", "1"), api) == (
        "driver",
        "driver",
    )
    assert _group(proc(13, "/ray/core/src/ray/gcs/gcs_server", "--x"), api) == (
        "head",
        "gcs_server",
    )
    assert _group(proc(14, "ray::IDLE"), api) is None
