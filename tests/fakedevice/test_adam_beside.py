"""Host Adam beside backward (`Engine.backward_and_step`, [Note: Adam beside backward] in
`pstar_core/beside.py`) on the second device with a modeled link: chunks backward is done
with are updated while it goes on, to the bit as backward then step; where a norm needs
every gradient first it waits; a failure after it began wants a saved state."""

from __future__ import annotations

import threading

import pytest
import torch

from pstar_core.chunk import ChunkType
from tests import fakedevice
from tests.core.helpers import batches, run_engine
from tests.fakedevice.test_engine_on_fakegpu import DEV, half_the_params, make


@pytest.fixture(scope="module", autouse=True)
def fake():
    return fakedevice.load()


def run_backward_and_step(engine, data, micro_batches: int = 1) -> tuple[list[float], list[int]]:
    """`run_engine` with each step's last backward `backward_and_step`: the losses, and
    the chunks whose Adam ran beside backward at each step."""
    losses, beside = [], []
    for x in data:
        parts, total = x.chunk(micro_batches), 0.0
        for k, mb in enumerate(parts):
            loss = engine(input_ids=mb, labels=mb).loss / micro_batches
            total += loss.item()
            if k == len(parts) - 1:
                engine.backward_and_step(loss)
            else:
                engine.backward(loss)
        losses.append(total)
        beside.append(engine.stats()["adam_beside_backward_chunks"])
    return losses, beside


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_adam_beside_backward_updates_host_chunks_during_it_bitwise_as_after_it(
    fake, micro_batches
):
    """Adam on the host for every chunk (half the parameters fit), over a modeled link:
    with `backward_and_step`, once the trace is followed, chunks backward is done with are
    updated while it goes on, and the losses and every weight are those of `backward()`
    then `step()`, to the bit (accumulation folded beside it too)."""
    budget = half_the_params()
    data = batches(4)
    fake.set_link(2.0, 2.0, 0.0)
    try:
        plain = make("gpt", DEV, {"device_budget": budget})
        expected = run_engine(plain, data, micro_batches=micro_batches)
        plain_state = {k: v.cpu() for k, v in plain.state_dict().items()}
        plain.close()
        engine = make("gpt", DEV, {"device_budget": budget})
        losses, beside = run_backward_and_step(engine, data, micro_batches)
        state = {k: v.cpu() for k, v in engine.state_dict().items()}
        assert engine.stats()["device_adam_chunks"] == 0
        engine.close()
    finally:
        fake.set_link(0.0)
    assert losses == expected
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name
    assert beside[0] == 0  # the warm-up records the trace: nothing beside it
    assert max(beside[1:]) > 0, beside


def test_adam_waits_for_backward_where_a_norm_needs_every_gradient_first(fake):
    """With gradient clipping the global norm needs every gradient before any update:
    `backward_and_step` is then backward, then step (nothing beside it), with the same
    losses as those two calls."""
    budget = half_the_params()
    data = batches(3)
    plain = make("gpt", DEV, {"device_budget": budget}, gradient_clipping=0.5)
    expected = run_engine(plain, data)
    plain.close()
    engine = make("gpt", DEV, {"device_budget": budget}, gradient_clipping=0.5)
    losses, beside = run_backward_and_step(engine, data)
    engine.close()
    assert losses == expected
    assert beside == [0, 0, 0]


def test_a_backward_that_fails_once_adam_beside_it_began_wants_a_saved_state(fake, tmp_path):
    """Backward fails after Adam beside it updated some chunks: the model holds a step
    applied to part of it, so the engine refuses to train on until a checkpoint is
    loaded; from the checkpoint it trains as a run that never failed."""
    budget = half_the_params()
    data = batches(4)
    plain = make("gpt", DEV, {"device_budget": budget})
    expected = run_engine(plain, data)
    plain.close()
    fake.set_link(2.0, 2.0, 0.0)  # a device with copy streams: gradients cross in backward
    try:
        _fail_once_beside_backward(budget, data, expected, tmp_path)
    finally:
        fake.set_link(0.0)


def _fail_once_beside_backward(budget, data, expected, tmp_path) -> None:
    engine = make("gpt", DEV, {"device_budget": budget})
    losses, _ = run_backward_and_step(engine, data[:2])
    engine.save_checkpoint(tmp_path / "ckpt")
    failing = {"on": True}

    def fail_late(_module, _args, out):  # the embedding's output: its gradient comes last
        def boom(_grad):
            if failing["on"]:
                raise RuntimeError("injected failure late in backward")

        out.register_hook(boom)

    hook = engine.module.wte.register_forward_hook(fail_late)
    loss = engine(input_ids=data[2], labels=data[2]).loss
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.backward_and_step(loss)
    with pytest.raises(RuntimeError, match="load a checkpoint"):
        engine(input_ids=data[2], labels=data[2])
    failing["on"] = False
    hook.remove()
    engine.load_checkpoint(tmp_path / "ckpt")
    after, _ = run_backward_and_step(engine, data[2:])
    engine.close()
    assert losses + after == expected


def test_under_zero_a_reduction_done_in_backward_sends_its_chunk_on_to_adam_beside_it(tmp_path):
    """Chunk ZeRO on two ranks of the second device, over a modeled link, all Adam on the
    host: a reduce-scatter that is done while backward goes on is finished then, its own
    chunk's gradients leave the group's buffer for the host by a copy out, and its Adam
    runs beside backward. Each rank's losses are those of backward, then step."""
    import json

    from tests.core.helpers import spawn_ranks

    env = {
        "PSTAR_TEST_DEVICE": DEV,
        "PSTAR_TEST_CHUNK": "4096",
        "PSTAR_FAKEGPU_LINK": "2,2,0",
        "PSTAR_TEST_MEMORY": json.dumps({"device_budget": 800_000}),
    }
    beside = spawn_ranks(
        "tests.core.zero_worker", 2, tmp_path / "beside", "train", PSTAR_TEST_BESIDE="1", **env
    )
    plain = spawn_ranks("tests.core.zero_worker", 2, tmp_path / "plain", "train", **env)
    for b, p in zip(beside, plain, strict=True):
        assert b["losses"] == p["losses"]
        assert b["device_adam_chunks"] == 0
        assert max(b["beside"]) > 0, b["beside"]


def test_chunks_whose_gradients_land_after_backward_host_side_start_as_each_lands(fake):
    """On a GPU the host launches backward ahead of the device, so at its operators few
    gradients have landed. With no start at backward's operators (as there), every
    host-Adam chunk still starts before the step, each as its copy out lands
    (`AdamBesideBackward.drain`), one Adam at a time on the host, and the losses are
    those of backward then step, to the bit."""
    budget = half_the_params()
    data = batches(4)
    fake.set_link(2.0, 2.0, 0.0)
    try:
        plain = make("gpt", DEV, {"device_budget": budget})
        expected = run_engine(plain, data)
        plain.close()
        engine = make("gpt", DEV, {"device_budget": budget})
        engine.manager.backward_operator = lambda: None  # the host ran ahead of every copy
        opt, running, most = engine.optimizer, [0], [0]
        adam = opt.adam

        def counted(*args, **kwargs):
            running[0] += 1
            most[0] = max(most[0], running[0])
            try:
                return adam(*args, **kwargs)
            finally:
                running[0] -= 1

        opt.adam = counted
        losses, beside = run_backward_and_step(engine, data)
        trainable = sum(
            1
            for c in engine.manager.own_chunks([ChunkType.PARAM])
            if any(s.trainable for s in c.slots)
        )
        engine.close()
    finally:
        fake.set_link(0.0)
    assert losses == expected
    assert beside[0] == 0
    assert beside[1:] == [trainable] * 3, (beside, trainable)
    assert most[0] == 1


def test_a_chunk_left_to_the_step_waits_for_host_adam_under_way_only_if_its_adam_is_on_the_host(
    fake,
):
    """One Adam at a time on the host's cores: a chunk whose Adam the step runs on the
    host waits for the updates under way beside backward; one whose Adam runs on the
    device does not (its kernels do not use the host's cores)."""
    from concurrent.futures import Future

    engine = make("gpt", DEV, {"device_budget": half_the_params()})
    try:
        beside = engine.optimizer.beside
        engine.manager.device_adam = {0}
        under_way: Future = Future()
        beside._running[1] = (under_way, [])
        waited = []

        def quiet(index: int) -> threading.Thread:
            t = threading.Thread(target=beside.quiet, args=(index,))
            t.start()
            t.join(timeout=0.5)
            waited.append(t.is_alive())
            return t

        quiet(0)  # Adam on the device: goes on at once
        left = quiet(2)  # on the host: waits for chunk 1's update
        under_way.set_result(None)
        left.join(timeout=5)
        assert waited == [False, True]
        assert not left.is_alive()
        beside.finish(1)
    finally:
        engine.close()
