"""Early stopping (service/worker/early_stopping.py) on the loss and on a reward: the best
evaluation, patience after the warm-up, and what the job object and the stop message say
of the metric watched."""

from __future__ import annotations

from service.worker.early_stopping import EarlyStopping

SETTINGS = {"patience": 2, "min_delta": 0.01, "warmup_evals": 1}
REWARD = ("valid_reward_mean", -1.0)


def test_the_loss_stops_after_patience_evaluations_without_improving():
    es = EarlyStopping.of(SETTINGS)
    verdicts = [es.observe(s, v) for s, v in [(0, 2.0), (10, 1.5), (20, 1.495), (30, 1.6)]]
    assert verdicts == ["improved", "improved", "wait", "stop"]
    view = es.view()
    assert (view["watched"], view["best_value"], view["best_valid_loss"]) == (
        "valid_loss",
        1.5,
        1.5,
    )
    assert (view["best_step"], view["stopped_at_step"]) == (10, 30)
    assert es.reason().startswith("the validation loss has not improved by more than 0.01")


def test_a_reward_is_watched_higher_being_better_and_named_as_itself():
    es = EarlyStopping.of(SETTINGS, watched=REWARD)
    rewards = [(0, 0.1), (10, 0.3), (20, 0.25), (30, 0.305)]
    assert [es.observe(s, -r) for s, r in rewards] == ["improved", "improved", "wait", "stop"]
    view = es.view()
    assert (view["watched"], view["best_value"], view["best_step"]) == (
        "valid_reward_mean",
        0.3,
        10,
    )
    assert "best_valid_loss" not in view  # a negated reward under a loss's name would mislead
    assert es.reason() == (
        "valid_reward_mean has not risen by more than 0.01 for 2 evaluations (patience 2); "
        "the best, 0.3000, was at step 10"
    )


def test_a_resumed_run_decides_as_the_uninterrupted_one():
    straight = EarlyStopping.of(SETTINGS, watched=REWARD)
    for s, r in [(0, 0.1), (10, 0.3)]:
        straight.observe(s, -r)
    state = straight.state()
    assert "watched" not in state  # the run's, not the checkpoint's
    resumed = EarlyStopping.of(SETTINGS, state, watched=REWARD)
    for s, r in [(20, 0.25), (30, 0.2)]:
        assert resumed.observe(s, -r) == straight.observe(s, -r)
    assert resumed.view() == straight.view()
    assert resumed.stopped
