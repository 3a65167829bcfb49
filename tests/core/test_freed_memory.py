"""When the engine hands glibc's free memory back (`tiers.FreedMemory`, see [Note: what a
step needs]), on a simulated process: RSS read at each step's end, a trim returning every
free page (so the next step faults its activations in again)."""

from __future__ import annotations

from pstar_core.tiers import FreedMemory

MB = 2**20
SLACK = 64 * MB
R0 = 1000 * MB  # chunks, weights, the interpreter


class Process:
    """A step ends holding its transient memory (activations, grads, logits: glibc keeps
    them) plus `growth` per step that nothing reuses (fragmentation) until a trim."""

    def __init__(self, transient: int, growth: int = 0) -> None:
        self.transient, self.growth = transient, growth
        self.kept = 0
        self.rss = R0
        self.faulted_in = 0  # bytes steps had to fault back in after a trim

    def step(self) -> None:
        self.kept += self.growth
        end = R0 + self.transient + self.kept
        self.faulted_in += max(0, R0 + self.transient - self.rss)
        self.rss = end

    def trim(self) -> None:
        self.kept = 0
        self.rss = R0


def run(proc: Process, steps: int, change=None) -> tuple[FreedMemory, list[int]]:
    freed = FreedMemory(SLACK, rss=lambda: proc.rss, trim=proc.trim)
    ends = []
    for i in range(steps):
        if change is not None:
            change(i, proc)
        proc.step()
        ends.append(proc.rss)
        freed.maybe_return()
    return freed, ends


def test_the_memory_every_step_allocates_again_is_not_given_back():
    # 300 MB of activations a step, far above the slack: trimming them at every step end
    # (what comparing with the RSS after the last trim did) makes each step fault them in
    proc = Process(transient=300 * MB)
    freed, _ = run(proc, 12)
    assert freed.trims == 0
    assert proc.faulted_in == 300 * MB  # the first step only


def test_a_footprint_that_grows_for_good_is_trimmed_once_then_taken_as_the_new_reference():
    def longer_batches(i: int, proc: Process) -> None:
        if i == 5:
            proc.transient = 500 * MB

    proc = Process(transient=300 * MB)
    freed, _ = run(proc, 12, longer_batches)
    assert freed.trims == 1
    assert freed.base == R0 + 500 * MB


def test_memory_that_piles_up_step_over_step_is_still_given_back():
    proc = Process(transient=300 * MB, growth=20 * MB)
    freed, ends = run(proc, 20)
    assert freed.trims >= 4
    # never more than the slack and one step's growth above what the first step held
    assert max(ends) <= ends[0] + SLACK + 20 * MB
    unbounded = Process(transient=300 * MB, growth=20 * MB)
    for _ in range(20):
        unbounded.step()
    assert unbounded.rss > max(ends) + 200 * MB
