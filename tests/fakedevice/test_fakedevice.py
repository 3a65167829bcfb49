"""The fakegpu device and the fakenccl backend behave like a GPU and NCCL would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

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
    assert (fake.is_available(), fake.device_count(), fake.current_device()) == (True, 1, 0)
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
