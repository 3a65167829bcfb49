"""The fakegpu device and the fakenccl backend behave like a GPU and NCCL would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests import fakedevice

DEV = "fakegpu"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def fake():
    return fakedevice.load()


def test_device_identity_and_module(fake):
    x = torch.ones(3, device="fakegpu:0")
    assert x.device == torch.device("fakegpu", 0)
    assert x.is_fakegpu
    assert not x.is_cpu
    assert torch.fakegpu is fake is fakedevice.load()  # idempotent
    devices = int(os.environ.get("PSTAR_FAKEGPU_DEVICES", "2"))
    assert (fake.is_available(), fake.device_count(), fake.current_device()) == (True, devices, 0)
    assert torch.ones(2).fakegpu().device.type == DEV  # generated methods
    assert nn.Linear(2, 2).fakegpu().weight.device.type == DEV
    assert {"empty.memory_format", "_copy_from", "as_strided"} <= set(fake.registered_kernels())
    assert "native_layer_norm" in fake.routed_to_cpu_kernels()
    fake.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_copies_both_ways_are_bitwise(dtype):
    src = (torch.randn(7, 5) * 100).to(dtype)
    dev = src.to(DEV)
    assert dev.dtype == dtype
    assert dev.shape == src.shape
    assert torch.equal(dev.cpu(), src)
    # non-contiguous both ways, device to device, and a converting copy
    assert torch.equal(src.t().to(DEV).cpu(), src.t())
    assert torch.equal(dev.t().cpu(), src.t())
    dst = torch.empty(5, 7, dtype=dtype, device=DEV)
    dst.copy_(dev.t())
    assert torch.equal(dst.cpu(), src.t())
    assert torch.equal(dev.to(torch.float64).cpu(), src.to(torch.float64))
    host = torch.zeros(5, 7, dtype=dtype)
    host.copy_(dev.t())
    assert torch.equal(host, src.t())


def test_in_place_ops_on_views_write_the_flat_buffer():
    flat = torch.arange(12.0, device=DEV)
    ref = torch.arange(12.0)
    for t in (flat, ref):
        t[2:5].add_(1)
        t.view(-1)[7].fill_(-3)
        t.narrow(0, 8, 3).zero_()
        t.view(3, 4)[:, 1].mul_(10)  # strided view
        t.unfold(0, 2, 2)[1, 0] = 42  # unfold: a view op that runs in the fallback
    assert torch.equal(flat.cpu(), ref)
    # views share the storage, as on a GPU
    v = flat[3:9].view(2, 3).t()
    assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # a parameter whose .data is a view into a chunk buffer (CPU placeholder <-> fakegpu)
    p = nn.Parameter(torch.zeros(4))
    p.data = flat[4:8]
    assert p.device.type == DEV
    with torch.no_grad():
        p.add_(1)
    assert flat[4:8].cpu().tolist() == (ref[4:8] + 1).tolist()
    p.data = torch.empty(0)
    assert p.device.type == "cpu"


def test_out_resize_and_storage_resize(fake):
    x = torch.arange(6.0, device=DEV)
    out = torch.empty(0, device=DEV)
    torch.add(x, 1, out=out)
    assert out.shape == (6,)
    assert out.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    r = torch.arange(4.0, device=DEV)
    r.resize_(10)
    assert r.shape == (10,)
    assert r[:4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    # the engine's way of releasing and re-materializing a chunk's memory
    before = fake.memory_allocated()
    buf = torch.empty(1000, device=DEV)
    buf.untyped_storage().resize_(0)
    assert fake.memory_allocated() == before
    buf.untyped_storage().resize_(4000)
    assert fake.memory_allocated() == before + 4000


def test_overlapping_in_place_raises_as_on_cuda():
    w = torch.arange(6.0, device=DEV)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        w[1:].add_(w[:-1])


def test_mixing_devices_raises_the_cuda_error():
    x = torch.ones(4, device=DEV)
    same = "Expected all tensors to be on the same device, but found at least two devices"
    with pytest.raises(RuntimeError, match=f"{same}, fakegpu:0 and cpu!"):
        x + torch.ones(4)
    with pytest.raises(RuntimeError, match="argument mat2"):
        x.view(2, 2) @ torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=same):
        torch.ones(4).add_(x)
    with pytest.raises(RuntimeError, match=same):
        torch.cat([x, torch.ones(4)])
    with pytest.raises(RuntimeError, match=same):
        nn.Linear(4, 4)(x)
    with pytest.raises(RuntimeError, match="Expected a 'fakegpu' device type for generator"):
        torch.randn(3, device=DEV, generator=torch.Generator())
    # allowed, as with CUDA: CPU scalars (0-dim), CPU index tensors, explicit copies
    assert (x * torch.tensor(2.0)).device.type == DEV
    assert x[torch.tensor([0, 2])].device.type == DEV
    x.copy_(torch.zeros(4))
    assert x.cpu().tolist() == [0.0] * 4


def test_numpy_refuses_device_tensors():
    with pytest.raises(TypeError, match="can't convert fakegpu:0 device type tensor to numpy"):
        torch.ones(2, device=DEV).numpy()


def test_memory_allocated_counts_exact_bytes(fake):
    base = fake.memory_allocated()
    fake.reset_peak_memory_stats()
    assert fake.max_memory_allocated() == base
    t = torch.empty(1000, dtype=torch.float32, device=DEV)
    u = torch.empty(3, 5, dtype=torch.bfloat16, device=DEV)
    assert fake.memory_allocated() == base + 4000 + 30
    v = t[10:20]  # a view allocates nothing
    assert fake.memory_allocated() == base + 4030
    del t
    assert fake.memory_allocated() == base + 4030  # the view keeps the storage alive
    del v
    assert fake.memory_allocated() == base + 30
    del u
    assert fake.memory_allocated() == base
    assert fake.max_memory_allocated() == base + 4030
    torch.ones(10, device="cpu")  # host memory is not counted
    assert fake.memory_allocated() == base


class TinyModel(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        h = self.ln(self.emb(ids))
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(F.gelu(h + a.transpose(1, 2).reshape(b, s, -1)))


def train(device: str, steps: int = 3, **adamw) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyModel().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **adamw)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 40, (2, 6), generator=data).to(device)
        logits = model(ids)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("adamw", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=str)
def test_training_equals_cpu_bitwise(adamw):
    cpu_losses, cpu_state = train("cpu", **adamw)
    dev_losses, dev_state = train(DEV, **adamw)
    assert dev_losses == cpu_losses
    for name, value in cpu_state.items():
        assert torch.equal(dev_state[name], value), name


def test_sdpa_forward_and_backward_equal_cpu_bitwise():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(5, 5) > 0.3
    mask.fill_diagonal_(True)
    dq, dk, dv = (t.detach().to(DEV).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask.to(DEV))
    assert torch.equal(out.cpu(), ref)
    ref.square().sum().backward()
    out.square().sum().backward()
    for a, b in ((q, dq), (k, dk), (v, dv)):
        assert torch.equal(b.grad.cpu(), a.grad)


def test_device_rng_is_its_own_and_checkpoint_replays_dropout(fake):
    torch.manual_seed(3)  # seeds fakegpu too (torch calls fakegpu.manual_seed_all)
    a = torch.randn(4, device=DEV)
    torch.manual_seed(3)
    assert torch.equal(torch.randn(4, device=DEV), a)
    cpu_state = torch.get_rng_state()
    torch.rand(8, device=DEV)
    F.dropout(torch.ones(8, device=DEV), 0.5)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # device draws leave the CPU RNG

    lin = nn.Linear(8, 8).to(DEV)
    x = torch.randn(4, 8, device=DEV, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return F.dropout(lin(t), 0.5, training=True)

    # an explicit fakegpu generator draws the stream a CPU generator with its seed would
    g = torch.Generator(device=DEV).manual_seed(7)
    assert g.device == torch.device(DEV, 0)
    drawn = torch.randn(4, device=DEV, generator=g).cpu()
    assert torch.equal(drawn, torch.randn(4, generator=torch.Generator().manual_seed(7)))

    state = fake.get_rng_state()
    block(x).square().sum().backward()
    plain = x.grad.clone()
    x.grad = None
    fake.set_rng_state(state)
    checkpoint(block, x, use_reentrant=False).square().sum().backward()
    assert torch.equal(x.grad, plain)


def test_pinned_host_memory():
    pinned = torch.empty(16).pin_memory()
    assert pinned.is_pinned()
    assert not torch.empty(16).is_pinned()
    assert torch.empty(4, pin_memory=True).is_pinned()
    assert torch.equal(pinned.fill_(2).to(DEV, non_blocking=True).cpu(), torch.full((16,), 2.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fakenccl_collectives_on_two_ranks():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.fakedevice.dist_worker", str(rank), "2", str(port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, text[-3000:]
        assert f"rank {rank} ok" in text
        # the CPU-tensor refusals happened (not just some other error)
        assert "fakenccl allreduce: got a tensor on cpu" in text
        assert "No backend type associated with device type cpu" in text


def test_autocast_follows_the_cuda_policy():
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x)
    lin, x = lin.to(DEV), x.to(DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        y = lin(x)  # lower precision, as a matmul on CUDA
        probs = F.softmax(y, -1)  # fp32, as on CUDA
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.cpu(), ref)
    assert probs.dtype == torch.float32


# ---------------------------------------------------------------------------------------
# Streams and events: a copy on a side stream happens when something waits for it
# ---------------------------------------------------------------------------------------


@pytest.fixture
def side(fake):
    """A new stream on fakegpu:0; whatever a test leaves queued runs afterwards."""
    yield torch.Stream(device="fakegpu:0")
    for i in range(fake.device_count()):
        fake.synchronize(i)


def _queued_h2d(side: torch.Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """dst (fakegpu, zeros) and src (pinned host) with dst.copy_(src) queued on `side`."""
    src = torch.arange(1.0, 9.0).pin_memory()
    dst = torch.zeros(8, device=DEV)
    with side:
        dst.copy_(src, non_blocking=True)
    return dst, src


def test_default_stream_copies_run_when_issued(fake):
    assert torch.accelerator.current_stream(0).stream_id == 0
    dst = torch.zeros(4, device=DEV)
    dst.copy_(torch.arange(4.0).pin_memory(), non_blocking=True)
    assert fake.pending_copies() == 0
    assert dst.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def _event_synchronize(side: torch.Stream, ev: torch.Event) -> None:
    ev.synchronize()


def _wait_event(side: torch.Stream, ev: torch.Event) -> None:
    torch.accelerator.current_stream(0).wait_event(ev)


def _wait_stream(side: torch.Stream, ev: torch.Event) -> None:
    torch.accelerator.current_stream(0).wait_stream(side)


def _stream_synchronize(side: torch.Stream, ev: torch.Event) -> None:
    side.synchronize()


def _device_synchronize(side: torch.Stream, ev: torch.Event) -> None:
    torch.fakegpu.synchronize(0)


@pytest.mark.parametrize(
    "wait",
    [_event_synchronize, _wait_event, _wait_stream, _stream_synchronize, _device_synchronize],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_side_stream_copy_is_invisible_until_waited_on(fake, side, wait):
    dst, src = _queued_h2d(side)
    ev = side.record_event()
    assert fake.pending_copies() == 1
    assert dst.cpu().tolist() == [0.0] * 8  # read without waiting: the old bytes
    wait(side, ev)
    assert fake.pending_copies() == 0
    assert torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("direction", ["host->device", "device->host", "device->device"])
def test_side_stream_copies_are_queued_in_every_direction(fake, side, direction):
    values = torch.arange(1.0, 7.0)
    src = values.to(DEV) if direction.startswith("device") else values.pin_memory()
    dst = torch.zeros(6, device=DEV) if direction.endswith("device") else torch.zeros(6)
    torch.accelerator.set_stream(side)  # as `with side:`
    try:
        assert torch.accelerator.current_stream(0) == side
        dst.copy_(src, non_blocking=True)
    finally:
        torch.accelerator.set_stream(fake.default_stream(0))
    assert dst.cpu().tolist() == [0.0] * 6
    side.synchronize()
    assert torch.equal(dst.cpu(), values)


def test_event_and_stream_queries_are_false_while_a_copy_is_queued(side):
    before = torch.Event(device="fakegpu:0")
    before.record(side)  # nothing queued yet
    _queued_h2d(side)
    after = torch.Event(device="fakegpu:0")
    after.record(side)
    assert before.query()
    assert not after.query()
    assert not side.query()
    after.synchronize()
    assert after.query()
    assert side.query()


def test_ops_issued_on_the_side_stream_run_after_its_queued_copies(side):
    dst, src = _queued_h2d(side)
    with side:
        dst.mul_(2)  # stream order: after the copy, not overwritten by it
        back = dst.cpu()  # a blocking copy on the stream sees what the stream did
    assert torch.equal(back, src * 2)
    assert torch.equal(dst.cpu(), src * 2)


def test_a_write_to_a_queued_copys_pinned_source_is_a_race_and_pageable_was_staged(side):
    """A DMA reads page-locked memory some time before its event: a write in between is a
    race, raised when the copy runs. CUDA staged pageable memory at the call: writing it
    after is fine."""
    pinned, pageable = torch.ones(4).pin_memory(), torch.ones(4)
    to_pinned, to_pageable = torch.zeros(4, device=DEV), torch.zeros(4, device=DEV)
    with side:
        to_pageable.copy_(pageable, non_blocking=True)
    pageable.fill_(7)
    side.synchronize()
    assert to_pageable.cpu().tolist() == [1.0] * 4
    with side:
        to_pinned.copy_(pinned, non_blocking=True)
    pinned.fill_(7)
    with pytest.raises(RuntimeError, match="written after the copy was issued"):
        side.synchronize()


def test_a_kernel_writing_a_queued_copys_device_source_is_a_race(side):
    """The copy stream waited for the compute stream's work so far; a kernel issued after
    the copy that writes its source races with it (the copy engine may read either)."""
    src = torch.arange(4.0, device=DEV)
    host = torch.zeros(4).pin_memory()
    with side:
        host.copy_(src, non_blocking=True)
    src.add_(1)  # on the compute stream, which never waited for the copy
    with pytest.raises(RuntimeError, match="written after the copy was issued"):
        side.synchronize()
    ok = torch.zeros(4).pin_memory()
    with side:
        ok.copy_(src, non_blocking=True)
    torch.fakegpu.current_stream().wait_stream(side)  # the compute stream waits first
    src.add_(1)
    side.synchronize()
    assert ok.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_dropping_a_tensor_a_queued_copy_reads_counts_a_hazard(fake, side):
    src = torch.arange(256.0, device=DEV)  # allocated on the default stream
    host = torch.zeros(256).pin_memory()
    hazards, allocated = fake.stream_hazards(), fake.memory_allocated(0)
    with side:
        host.copy_(src, non_blocking=True)
    del src
    assert fake.stream_hazards() == hazards + 1
    assert fake.memory_allocated(0) == allocated  # kept until the copy ran
    side.synchronize()
    assert fake.memory_allocated(0) == allocated - 1024
    assert torch.equal(host, torch.arange(256.0))


def test_releasing_the_storage_of_a_queued_copy_destination_counts_a_hazard(fake, side):
    dst, _src = _queued_h2d(side)
    hazards = fake.stream_hazards()
    dst.untyped_storage().resize_(0)  # how the engine releases a chunk's memory
    assert fake.stream_hazards() == hazards + 1


def test_record_stream_makes_dropping_a_tensor_a_queued_copy_uses_legal(fake, side):
    src = torch.arange(256.0, device=DEV)
    host = torch.zeros(256).pin_memory()
    hazards, allocated = fake.stream_hazards(), fake.memory_allocated(0)
    with side:
        host.copy_(src, non_blocking=True)
    src.record_stream(side)
    del src
    assert fake.stream_hazards() == hazards
    assert fake.memory_allocated(0) == allocated
    side.synchronize()
    assert fake.memory_allocated(0) == allocated - 1024
    assert torch.equal(host, torch.arange(256.0))


def test_dropping_a_tensor_allocated_on_the_copy_stream_is_legal(fake, side):
    hazards = fake.stream_hazards()
    with side:
        dev = torch.ones(64).pin_memory().to(DEV, non_blocking=True)
    assert fake.pending_copies() == 1
    del dev
    assert fake.stream_hazards() == hazards


# ---------------------------------------------------------------------------------------
# Pinned host memory
# ---------------------------------------------------------------------------------------


@pytest.fixture
def link(fake):
    """A modeled link of 1 GB/s each way and no latency ([Note: a modeled link]); off
    again after the test. 32 MiB take 33.6 ms on it."""
    fake.set_link(1.0, 1.0, 0.0)
    yield fake
    fake.set_link(0.0)


MIB32, COPY_S = 32 << 20, (32 << 20) / 1e9


def _host_and_device() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(MIB32, dtype=torch.uint8).pin_memory(), torch.empty(
        MIB32, dtype=torch.uint8, device=DEV
    )


def test_without_a_link_copies_cost_no_modeled_time(fake):
    fake.set_link(0.0)
    host, dev = _host_and_device()
    dev.copy_(host)
    stats = fake.link_stats()["host_to_device"]
    assert (stats["copies"], stats["waited_s"], stats["busy_s"]) == (0, 0.0, 0.0)


def test_a_blocking_copy_over_the_link_holds_the_host_for_its_time(link):
    host, dev = _host_and_device()
    dev.copy_(host)  # the host waits for it, as CUDA's blocking copy makes it
    up = link.link_stats()["host_to_device"]
    assert up["copies"] == 1
    assert up["bytes"] == MIB32
    assert up["busy_s"] == pytest.approx(COPY_S)
    assert up["waited_s"] >= 0.95 * COPY_S  # nothing hid it
    host.copy_(dev)  # and the other direction has its own engine and bandwidth
    assert link.link_stats()["device_to_host"]["waited_s"] >= 0.95 * COPY_S
    assert torch.equal(host, torch.ones(MIB32, dtype=torch.uint8))


def _upload_on(side: torch.Stream) -> tuple[torch.Tensor, Any]:
    """32 MiB of ones queued host->device on `side` into zeros: (the device tensor, the
    event after the copy)."""
    host, dev = _host_and_device()
    dev.zero_()
    with side:
        dev.copy_(host, non_blocking=True)
        done = torch.Event(device="fakegpu:0")
        done.record(side)
    return dev, done


def test_a_copy_on_a_side_stream_hides_behind_host_work(link, side):
    """Queued on a copy stream, the copy runs while the host computes (here it sleeps
    longer than the copy takes): waiting for it then costs nothing; its bytes still land
    only when waited for."""
    import time

    dev, done = _upload_on(side)
    time.sleep(2 * COPY_S)  # the host's own work
    assert not bool(dev.cpu()[0])  # not waited for: the old bytes
    done.synchronize()
    up = link.link_stats()["host_to_device"]
    assert up["waited_s"] == 0.0
    assert up["busy_s"] == pytest.approx(COPY_S)
    assert bool(dev.cpu()[0])


def test_with_a_link_an_event_is_done_once_its_copy_time_has_passed(link, side):
    """As on a GPU, `query()` says whether the copy is done: false before its modeled
    time, true after (its bytes land then, with no host time spent waiting)."""
    import time

    dev, done = _upload_on(side)
    assert not done.query()
    time.sleep(1.5 * COPY_S)
    assert done.query()
    assert bool(dev.cpu()[0])
    assert link.link_stats()["host_to_device"]["waited_s"] == 0.0


def test_copies_queue_on_their_directions_engine_and_streams_order_them(link, side):
    """Two host-to-device copies issued together are done one after the other; a
    device-to-host copy on another stream runs beside them, on the other engine; one on the
    uploads' stream waits for them (a stream orders its work)."""
    import time

    host, dev = _host_and_device()
    host2, dev2 = _host_and_device()
    on_device = torch.ones(MIB32, dtype=torch.uint8, device=DEV)  # made there: no copy
    back = torch.empty(MIB32, dtype=torch.uint8).pin_memory()
    down_stream = torch.Stream(device="fakegpu:0")
    issued = time.monotonic()
    with side:
        dev.copy_(host, non_blocking=True)
        dev2.copy_(host2, non_blocking=True)
    with down_stream:
        back.copy_(on_device, non_blocking=True)
    stats = link.link_stats()
    up, down = stats["host_to_device"], stats["device_to_host"]
    assert up["free_at_s"] - issued >= 2 * COPY_S - 1e-6  # the second waited for the first
    assert down["free_at_s"] < up["free_at_s"] - 0.5 * COPY_S  # beside the uploads
    with side:  # behind the uploads on their stream
        host.copy_(dev2, non_blocking=True)
    behind = link.link_stats()["device_to_host"]["free_at_s"]
    assert behind >= up["free_at_s"] + COPY_S - 1e-6  # (seconds from integer nanoseconds)
    link.synchronize(0)
    assert torch.equal(back, torch.ones(MIB32, dtype=torch.uint8))


def test_the_link_is_set_from_the_environment_and_checked(monkeypatch):
    from tests.fakedevice import _env_link

    monkeypatch.setenv("PSTAR_FAKEGPU_LINK", "25,12.5,10")
    assert _env_link() == (25.0, 12.5, 10.0)
    monkeypatch.setenv("PSTAR_FAKEGPU_LINK", "fast")
    with pytest.raises(ValueError, match="H2D_GBps,D2H_GBps,latency_us"):
        _env_link()


def test_host_register_pins_a_range_and_counts_its_bytes(fake):
    buf, other = torch.zeros(4096, dtype=torch.uint8), torch.zeros(16)
    before = fake.pinned_bytes()
    assert not buf.is_pinned()
    fake.host_register(buf.data_ptr(), buf.nbytes)
    try:
        assert fake.pinned_bytes() == before + 4096
        assert buf.is_pinned()
        assert buf[1000:].is_pinned()  # a view inside the range
        assert not other.is_pinned()
    finally:
        fake.host_unregister(buf.data_ptr())
    assert fake.pinned_bytes() == before
    assert not buf.is_pinned()


def test_host_register_refuses_overlaps_and_unknown_pointers(fake):
    buf = torch.zeros(4096, dtype=torch.uint8)
    fake.host_register(buf.data_ptr(), 2048)
    try:
        with pytest.raises(RuntimeError, match="cudaErrorHostMemoryAlreadyRegistered"):
            fake.host_register(buf.data_ptr() + 1024, 2048)
        with pytest.raises(RuntimeError, match="cudaErrorHostMemoryAlreadyRegistered"):
            fake.host_register(torch.empty(8).pin_memory().data_ptr(), 32)
        with pytest.raises(RuntimeError, match="cudaErrorHostMemoryNotRegistered"):
            fake.host_unregister(buf.data_ptr() + 1024)
    finally:
        fake.host_unregister(buf.data_ptr())
    with pytest.raises(RuntimeError, match="cudaErrorHostMemoryNotRegistered"):
        fake.host_unregister(buf.data_ptr())


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_copy_must_stay_inside_the_page_locked_range_it_touches(fake, non_blocking):
    """As CUDA: a copy whose host side runs past the end of its registration, into the
    next one or into unregistered memory, is cudaErrorInvalidValue (seen on an H200 with
    a chunk straddling two slices of the pinned pool); one inside a range copies."""
    buf = torch.arange(8192, dtype=torch.int32).view(torch.uint8)  # 32 KiB, 8 pages
    half = buf.nbytes // 2
    fake.host_register(buf.data_ptr(), half)
    fake.host_register(buf.data_ptr() + half, half)
    try:
        inside = buf[:half].to(DEV, non_blocking=non_blocking)
        torch.fakegpu.synchronize()
        assert torch.equal(inside.cpu(), buf[:half])
        across = buf[half - 4096 : half + 4096]
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            across.to(DEV, non_blocking=non_blocking)
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            across.copy_(torch.zeros(8192, dtype=torch.uint8, device=DEV), non_blocking)
    finally:
        fake.host_unregister(buf.data_ptr())
        fake.host_unregister(buf.data_ptr() + half)
    assert torch.equal(buf[half - 4096 : half + 4096].to(DEV).cpu(), buf[half - 4096 : half + 4096])


def test_pinned_allocator_rounds_up_to_a_power_of_two_and_never_gives_back(fake):
    mib = 1 << 20
    requested, held = fake.pinned_allocator_bytes(), fake.pinned_allocator_held_bytes()
    # 100 MiB: a size class (128 MiB) nothing else pins; never touched, so never resident
    t = torch.empty(100 * mib, dtype=torch.uint8, pin_memory=True)
    assert t.is_pinned()
    assert fake.pinned_allocator_bytes() == requested + 100 * mib
    assert fake.pinned_allocator_held_bytes() == held + 128 * mib
    del t
    assert fake.pinned_allocator_bytes() == requested
    assert fake.pinned_allocator_held_bytes() == held + 128 * mib  # cached, not freed
    again = torch.empty(120 * mib, dtype=torch.uint8, pin_memory=True)  # the cached block
    assert fake.pinned_allocator_held_bytes() == held + 128 * mib
    assert fake.pinned_allocator_bytes() == requested + 120 * mib
    del again


# ---------------------------------------------------------------------------------------
# Memory capacity
# ---------------------------------------------------------------------------------------


@pytest.fixture
def capacity(fake):
    """Lets a test set capacities; puts the previous ones back."""
    totals = [fake.mem_get_info(i)[1] for i in range(fake.device_count())]
    yield fake.set_capacity
    for i, total in enumerate(totals):
        fake.set_capacity(total, i)


def test_mem_get_info_is_capacity_minus_allocated(fake, capacity):
    capacity(64 << 20)
    free, total = fake.mem_get_info(0)
    assert total == 64 << 20
    assert free == total - fake.memory_allocated(0)
    t = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
    assert fake.mem_get_info("fakegpu:0") == (free - (1 << 20), total)
    assert torch.accelerator.get_memory_info(0) == (free - (1 << 20), total)
    del t


def test_allocating_past_the_capacity_raises_out_of_memory(fake, capacity):
    mib = 1 << 20
    capacity(fake.memory_allocated(0) + mib, 0)
    with pytest.raises(
        torch.OutOfMemoryError, match=r"fakegpu out of memory: tried to allocate 2\.00 MiB"
    ):
        torch.empty(2 * mib, dtype=torch.uint8, device=DEV)
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    fits = torch.empty(mib, dtype=torch.uint8, device=DEV)
    assert fake.mem_get_info(0)[0] == 0
    del fits


# ---------------------------------------------------------------------------------------
# Two devices
# ---------------------------------------------------------------------------------------


@pytest.fixture
def two(fake):
    if fake.device_count() < 2:
        pytest.skip("PSTAR_FAKEGPU_DEVICES=1")
    return fake


def test_each_device_counts_its_own_memory_and_computes_in_place(two):
    zero, one = two.memory_allocated(0), two.memory_allocated(1)
    x = torch.ones(100, device="fakegpu:1")
    assert (two.memory_allocated(0), two.memory_allocated(1)) == (zero, one + 400)
    y = (x * 2).sum()  # the CPU kernels' results come back on the inputs' device
    assert y.device == torch.device("fakegpu:1")
    assert y.item() == 200.0
    del y
    moved = x.to("fakegpu:0")
    assert moved.device == torch.device("fakegpu:0")
    assert (two.memory_allocated(0), two.memory_allocated(1)) == (zero + 400, one + 400)
    assert torch.accelerator.memory_allocated(1) == one + 400


def test_mixing_two_devices_raises_the_cuda_error(two):
    x0, x1 = torch.ones(4, device="fakegpu:0"), torch.ones(4, device="fakegpu:1")
    same = "Expected all tensors to be on the same device, but found at least two devices"
    with pytest.raises(RuntimeError, match=f"{same}, fakegpu:0 and fakegpu:1!"):
        x0 + x1
    with pytest.raises(RuntimeError, match=f"{same}, fakegpu:1 and fakegpu:0!"):
        x1.add_(x0)


def test_the_current_device_places_tensors_without_an_index(two):
    assert two.current_device() == 0
    with two.device(1):
        assert two.current_device() == 1
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(2, device=DEV).device == torch.device("fakegpu:1")
    assert torch.empty(2, device=DEV).device == torch.device("fakegpu:0")
    two.set_device(1)
    try:
        assert torch.arange(3, device=DEV).device == torch.device("fakegpu:1")
    finally:
        two.set_device(0)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        two.set_device(two.device_count())
