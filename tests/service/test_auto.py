"""The rules of every "auto" (`service.spec.auto`), each as a user would meet it."""

import math

import pytest

from service.spec import auto


def test_auto_seq_len_rounds_up_to_a_multiple_of_16():
    assert auto.seq_len(17, 2048) == 32
    assert auto.seq_len(32, 2048) == 32


def test_auto_seq_len_is_at_least_16():
    assert auto.seq_len(3, 2048) == 16


def test_auto_seq_len_is_capped():
    assert auto.seq_len(1000, 2048) == 512
    assert auto.seq_len(1000, 2048, cap=256) == 256


def test_auto_seq_len_stays_within_the_models_positions():
    assert auto.seq_len(300, 128) == 128


@pytest.mark.parametrize(
    ("examples", "workers", "want"), [(1, 1, 1), (5, 1, 5), (100, 1, 8), (5, 2, 6), (100, 3, 9)]
)
def test_auto_batch_size_is_up_to_8_and_a_multiple_of_the_workers(examples, workers, want):
    assert auto.batch_size(examples, workers) == want


def test_auto_epochs_sees_about_100_examples_within_3_to_10_passes():
    assert auto.epochs(10_000) == 3
    assert auto.epochs(20) == 5
    assert auto.epochs(1) == 10


def test_the_learning_rate_is_the_engines_when_positive_else_the_kinds():
    assert auto.learning_rate("zoo", 2.0) == (1e-3, 2e-3)
    assert auto.learning_rate("base", 0.5, 4e-4) == (4e-4, 2e-4)
    # a flag, zero or a string is not a rate: the kind's base stands
    for odd in (True, 0, -1.0, "1e-3", None):
        assert auto.learning_rate("base", 1.0, odd) == (1e-4, 1e-4)
    base, lr = auto.learning_rate("base", math.inf)
    assert base == 1e-4
    assert not math.isfinite(lr)  # the caller refuses it, naming the field


def test_packing_auto_packs_past_a_third_of_padding():
    assert not auto.packing("auto", auto.AUTO_PADDING_SHARE)
    assert auto.packing("auto", auto.AUTO_PADDING_SHARE + 0.01)
    assert auto.packing(True, 0.0)
    assert not auto.packing(False, 0.9)


def test_checkpoints_default_to_quarters_where_a_restart_resumes_else_the_end():
    assert auto.checkpoint_every(None, 10, True) == 3
    assert auto.checkpoint_every(None, 10, False) == 0
    assert auto.checkpoint_every(7, 10, False) == 7


def test_evaluations_default_to_ten_a_run():
    assert auto.eval_every(None, 100) == 10
    assert auto.eval_every(None, 5) == 1
    assert auto.eval_every(0, 100) == 0
