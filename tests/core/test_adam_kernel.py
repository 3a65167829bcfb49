"""Tests of the chunk AdamW kernel (pstar_core.kernels.adam): math vs torch.optim.AdamW,
segment isolation, grad/param_out aliasing, exact down-casts, grad_scale, grad_sq_norm and
agreement of the C++ and torch backends."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pstar_core.kernels import adam as adam_mod
from pstar_core.kernels.adam import AdamSegment, adamw_, grad_sq_norm, kernel_backend

BETAS = (0.9, 0.999)
EPS = 1e-8
N = 4096
# (offset, numel, lr, weight_decay, first iteration the segment takes part in): gaps at
# the start, between segments and at the end; the last one joins late so its step differs.
SEGS = [
    (7, 1000, 1e-2, 0.0, 1),
    (1100, 1501, 3e-3, 0.1, 1),
    (2700, 900, 1e-3, 0.01, 6),
]


# The C++ kernel's cases need it built (see [Note: tests that build C++] in conftest.py);
# the torch and fused cases are what the engine falls back to without it.
CPP = pytest.param("cpp", marks=pytest.mark.requires_compiler)


@pytest.fixture(params=[CPP, "torch", "fused"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PSTAR_ADAM_BACKEND", request.param)
    assert kernel_backend() == request.param
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bitwise comparison (NaN payloads included)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _run_vs_reference(
    grad_dtype: torch.dtype, out_dtype: torch.dtype, grad_scale: float = 1.0, steps: int = 20
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list, torch.Tensor]:
    """Drive adamw_ and one torch AdamW(foreach=False) per segment for `steps` iterations."""
    gen = torch.Generator().manual_seed(1234)
    master = torch.randn(N, generator=gen)
    exp_avg = torch.zeros(N)
    exp_avg_sq = torch.zeros(N)
    refs = []
    for off, cnt, lr, wd, _ in SEGS:
        p = torch.nn.Parameter(master[off : off + cnt].clone())
        opt = torch.optim.AdamW([p], lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)
        refs.append((p, opt))
    out = torch.zeros(N, dtype=out_dtype)
    for it in range(1, steps + 1):
        grad = torch.randn(N, generator=gen).to(grad_dtype)
        segs = [
            AdamSegment(off, cnt, it - first + 1, lr, wd)
            for off, cnt, lr, wd, first in SEGS
            if it >= first
        ]
        adamw_(master, exp_avg, exp_avg_sq, grad, out, segs,
               beta1=BETAS[0], beta2=BETAS[1], eps=EPS, grad_scale=grad_scale)  # fmt: skip
        for (off, cnt, _, _, first), (p, opt) in zip(SEGS, refs, strict=True):
            if it >= first:
                p.grad = grad[off : off + cnt].float() * grad_scale
                opt.step()
    return master, exp_avg, exp_avg_sq, out, refs, grad


def _assert_matches_reference(master, exp_avg, exp_avg_sq, refs, exact: bool) -> None:
    for (off, cnt, *_), (p, opt) in zip(SEGS, refs, strict=True):
        st = opt.state[p]
        pairs = [
            (master[off : off + cnt], p.detach()),
            (exp_avg[off : off + cnt], st["exp_avg"]),
            (exp_avg_sq[off : off + cnt], st["exp_avg_sq"]),
        ]
        for ours, ref in pairs:
            if exact:
                # The torch fallback runs the very ops of _single_tensor_adam.
                assert torch.equal(ours, ref)
            else:
                torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_adamw_over_20_steps(backend: str, grad_dtype: torch.dtype) -> None:
    master, exp_avg, exp_avg_sq, _, refs, _ = _run_vs_reference(grad_dtype, torch.bfloat16)
    _assert_matches_reference(master, exp_avg, exp_avg_sq, refs, exact=backend == "torch")
    # Every segment really moved away from its initial value.
    init = torch.randn(N, generator=torch.Generator().manual_seed(1234))
    for off, cnt, *_ in SEGS:
        assert (master[off : off + cnt] - init[off : off + cnt]).abs().min() > 0


def test_grad_scale_is_applied(backend: str) -> None:
    master, exp_avg, exp_avg_sq, _, refs, _ = _run_vs_reference(
        torch.float32, torch.float32, grad_scale=0.37, steps=8
    )
    _assert_matches_reference(master, exp_avg, exp_avg_sq, refs, exact=backend == "torch")
    # And it matters: without the scale the moments differ.
    unscaled = _run_vs_reference(torch.float32, torch.float32, grad_scale=1.0, steps=8)
    assert not torch.allclose(unscaled[1], exp_avg)


@pytest.mark.parametrize(
    ("grad_dtype", "out_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float16),
    ],
)
def test_outside_segments_untouched(
    backend: str, grad_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(7)
    bufs = [torch.randn(N, generator=gen) for _ in range(3)]
    bufs[1].abs_()
    bufs[2].abs_()
    grad = torch.randn(N, generator=gen).to(grad_dtype)
    out = torch.randn(N, generator=gen).to(out_dtype)
    # Poison the gaps: NaN/inf outside the segments must neither be read into nor changed.
    for t in (*bufs, grad, out):
        t[:7] = float("nan")
        t[N - 5 :] = float("inf")
    before = [t.clone() for t in (*bufs, grad, out)]
    segs = [AdamSegment(off, cnt, 3, lr, wd) for off, cnt, lr, wd, _ in SEGS]
    adamw_(*bufs, grad, out, segs, beta1=0.9, beta2=0.999, eps=1e-8)
    inside = torch.zeros(N, dtype=torch.bool)
    for s in segs:
        inside[s.offset : s.offset + s.numel] = True
    for new, old in zip((*bufs, grad, out), before, strict=True):
        assert torch.equal(_bits(new)[~inside], _bits(old)[~inside])
    for t in (*bufs, out):
        assert torch.isfinite(t[inside]).all()
    assert not torch.equal(bufs[0][inside], before[0][inside])
    assert torch.equal(_bits(out)[inside], _bits(bufs[0].to(out_dtype))[inside])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grad_and_param_out_may_alias(backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 70_000  # above the kernel's parallel threshold, several work pieces
    states = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
    grad = torch.randn(n, generator=gen).to(dtype)
    segs = [AdamSegment(0, 33_333, 2, 1e-2, 0.01), AdamSegment(40_000, 30_000, 5, 1e-3, 0.0)]
    kw = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "grad_scale": 0.5}

    sep = [t.clone() for t in states]
    sep_grad, sep_out = grad.clone(), torch.zeros(n, dtype=dtype)
    adamw_(*sep, sep_grad, sep_out, segs, **kw)

    slot = grad.clone()
    adamw_(*states, slot, slot, segs, **kw)
    for a, b in zip(states, sep, strict=True):
        assert torch.equal(a, b)
    for s in segs:
        sl = slice(s.offset, s.offset + s.numel)
        assert torch.equal(_bits(slot[sl]), _bits(sep_out[sl]))
    gap = slice(33_333, 40_000)
    assert torch.equal(_bits(slot[gap]), _bits(grad[gap]))  # gap still holds the grad


def _special_values() -> torch.Tensor:
    """fp32 values that exercise every rounding / overflow / subnormal corner."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F800001, 0x3F807FFF, 0xBF808000, 0x3F801000,
                         0x3F803000, 0x7F7FFFFF, 0x00000001, 0x80400000, 0x7F7F8000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)  # fmt: skip
    values = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e5, 6.1e-5,
                           5.96e-8, 2.98e-8, 2.99e-8, 1e-9, -3e-6, 3e38, float("inf"),
                           float("-inf"), 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8])  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    rand = torch.randn(3000, generator=gen) * torch.logspace(-30, 30, 3000)
    return torch.cat([ties, values, rand])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_param_out_cast_is_bitwise_torch(backend: str, dtype: torch.dtype) -> None:
    master = _special_values()
    n = master.numel()
    expected = master.to(dtype)
    # lr = 0 and no weight decay leave master unchanged (p - 0 * finite), so param_out is
    # exactly cast(original master) for every special value.
    out = torch.zeros(n, dtype=dtype)
    grad = torch.ones(n, dtype=dtype)
    adamw_(master, torch.zeros(n), torch.zeros(n), grad, out, [AdamSegment(0, n, 1, 0.0, 0.0)],
           beta1=0.9, beta2=0.999, eps=1e-8)  # fmt: skip
    assert torch.equal(_bits(out), _bits(expected))
    # NaN: any NaN is acceptable (torch itself is not consistent about the payload).
    nan_master = torch.full((64,), float("nan"))
    nan_out = torch.zeros(64, dtype=dtype)
    adamw_(nan_master, torch.zeros(64), torch.zeros(64), torch.ones(64, dtype=dtype), nan_out,
           [AdamSegment(0, 64, 1, 1e-3, 0.0)], beta1=0.9, beta2=0.999, eps=1e-8)  # fmt: skip
    assert torch.isnan(nan_out).all()
    # And after a real update, param_out is the cast of the new master.
    m2 = torch.randn(5000, generator=torch.Generator().manual_seed(9))
    g2 = torch.randn(5000).to(dtype)
    adamw_(m2, torch.zeros(5000), torch.zeros(5000), g2, g2, [AdamSegment(0, 5000, 4, 0.1, 0.1)],
           beta1=0.9, beta2=0.999, eps=1e-8)  # fmt: skip
    assert torch.equal(_bits(g2), _bits(m2.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_sq_norm(backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    n = 100_000
    grad = (torch.randn(n, generator=gen) * 3).to(dtype)
    segs = [AdamSegment(10, 40_000, 1, 1e-3, 0.0), AdamSegment(50_000, 49_000, 1, 1e-3, 0.0)]
    expected = sum(float((grad[s.offset : s.offset + s.numel].double() ** 2).sum()) for s in segs)
    assert grad_sq_norm(grad, segs) == pytest.approx(expected, rel=1e-12)
    assert grad_sq_norm(grad, []) == 0.0

    # Non-finite values outside the segments are ignored...
    grad[45_000] = float("inf")
    grad[n - 1] = float("nan")
    assert grad_sq_norm(grad, segs) == pytest.approx(expected, rel=1e-12)
    # ...inside they must surface (overflow detection relies on it).
    grad[20_000] = float("-inf")
    assert math.isinf(grad_sq_norm(grad, segs))
    grad[60_000] = float("nan")
    assert math.isnan(grad_sq_norm(grad, segs))
    # A huge-but-finite fp32 value squares fine in fp64 instead of overflowing.
    if dtype == torch.float32:
        big = torch.full((8,), 3e38)
        assert grad_sq_norm(big, [AdamSegment(0, 8, 1, 0.0, 0.0)]) == pytest.approx(8 * 9e76)


def _resident_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM"
)
def test_the_device_norm_of_a_bf16_chunk_needs_at_most_4_bytes_an_element() -> None:
    """The device path's sum of squares (the one torch ops compute; on a GPU for every
    chunk there): a norm asked for in fp64 read the whole gradient through an fp64 copy,
    8 bytes an element (4.2 GB for a Llama-3 embedding's). Read in pieces, the peak
    resident memory it adds stays under 4 bytes an element, and the sum is the fp64 one.
    (The host paths here run the same torch ops; the fake device runs CPU kernels out of
    its own accounting, so the process's peak is what shows it.)"""
    from pstar_core.kernels import grad_sq_norm_device

    n = 1 << 24
    grad = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    grad_sq_norm_device(grad[:1024], [AdamSegment(0, 1024, 0, 0.0, 0.0)])  # warm
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    before = _resident_bytes("VmRSS")
    total = grad_sq_norm_device(grad, [AdamSegment(0, n - 7, 0, 0.0, 0.0)])
    grown = _resident_bytes("VmHWM") - before
    expected = float((grad[: n - 7].double() ** 2).sum())
    assert float(total) == pytest.approx(expected, rel=1e-12)
    assert grown <= 4 * n, grown / n


@pytest.mark.requires_compiler
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpp_torch_and_fused_backends_agree(
    monkeypatch: pytest.MonkeyPatch, grad_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(21)
    n = 300_000
    init = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01,
            torch.rand(n, generator=gen) * 1e-4]  # fmt: skip
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    segs = [AdamSegment(0, 123_457, 3, 1e-3, 0.01), AdamSegment(123_457, 100_000, 7, 2e-3, 0.0),
            AdamSegment(250_000, 50_000, 1, 5e-4, 0.1)]  # fmt: skip
    results = {}
    for name in ("cpp", "torch", "fused"):
        monkeypatch.setenv("PSTAR_ADAM_BACKEND", name)
        assert kernel_backend() == name
        bufs = [t.clone() for t in init]
        slot = grad.clone()
        adamw_(*bufs, slot, slot, segs, beta1=0.9, beta2=0.95, eps=1e-6, grad_scale=0.8)
        results[name] = (bufs, slot, grad_sq_norm(grad, segs))
    (cb, cslot, cnorm), (tb, tslot, tnorm) = results["cpp"], results["torch"]
    fb, fslot, fnorm = results["fused"]  # torch._fused_adamw_, the GPU path
    for a, b, f in zip(cb, tb, fb, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(f, b, rtol=1e-6, atol=1e-7)
    # Inside the segments each backend's param_out is the exact cast of its own master;
    # in the gap (223_457..250_000) the slot still holds the gradient.
    inside = torch.zeros(n, dtype=torch.bool)
    for s in segs:
        inside[s.offset : s.offset + s.numel] = True
    for slot, master in ((cslot, cb[0]), (tslot, tb[0]), (fslot, fb[0])):
        assert torch.equal(_bits(slot)[inside], _bits(master.to(grad_dtype))[inside])
        assert torch.equal(_bits(slot)[~inside], _bits(grad)[~inside])
    assert cnorm == pytest.approx(tnorm, rel=1e-12)
    assert fnorm == pytest.approx(tnorm, rel=1e-12)


def test_invalid_arguments_are_rejected() -> None:
    n = 100
    f = [torch.zeros(n) for _ in range(3)]
    g = torch.zeros(n, dtype=torch.bfloat16)
    kw = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    with pytest.raises(ValueError, match="overlaps"):
        adamw_(*f, g, g, [AdamSegment(0, 50, 1, 1e-3, 0.0), AdamSegment(40, 10, 1, 1e-3, 0.0)],
               **kw)  # fmt: skip
    with pytest.raises(ValueError, match="outside"):
        adamw_(*f, g, g, [AdamSegment(90, 20, 1, 1e-3, 0.0)], **kw)
    with pytest.raises(ValueError, match="step"):
        adamw_(*f, g, g, [AdamSegment(0, 20, 0, 1e-3, 0.0)], **kw)
    with pytest.raises(ValueError, match="float32"):
        adamw_(f[0].double(), f[1], f[2], g, g, [AdamSegment(0, 20, 1, 1e-3, 0.0)], **kw)
    with pytest.raises(ValueError, match="overlap"):
        adamw_(f[0], f[0], f[2], g, g, [AdamSegment(0, 20, 1, 1e-3, 0.0)], **kw)
    with pytest.raises(ValueError, match="alias"):
        adamw_(*f, g, g.view(torch.float16), [AdamSegment(0, 20, 1, 1e-3, 0.0)], **kw)


def test_forced_torch_backend_and_bad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSTAR_ADAM_BACKEND", "torch")
    assert kernel_backend() == "torch"
    monkeypatch.setenv("PSTAR_ADAM_BACKEND", "fast")
    with pytest.raises(ValueError, match="PSTAR_ADAM_BACKEND"):
        kernel_backend()


def test_ext_cache_name_depends_on_source_and_cpu() -> None:
    src = "int x;"
    assert adam_mod._ext_name(src) == adam_mod._ext_name(src)
    assert adam_mod._ext_name(src) != adam_mod._ext_name(src + " ")


@pytest.mark.parametrize("cause", ["no compiler", "a compile error"])
def test_failed_build_falls_back_to_fused_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cause: str
) -> None:
    """Runs whether this machine has a compiler or not: into a fresh build directory the
    build fails either way."""
    if cause == "no compiler":
        monkeypatch.setenv("CXX", "/nonexistent/c++")  # what torch's cpp_extension calls
    else:
        broken = tmp_path / "adam.cpp"
        broken.write_text("#error deliberately broken\n")
        monkeypatch.setattr(adam_mod, "_SOURCE_PATH", broken)
    monkeypatch.setenv("PSTAR_EXT_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("PSTAR_ADAM_BACKEND", raising=False)
    monkeypatch.setattr(adam_mod, "_ext_module", None)
    monkeypatch.setattr(adam_mod, "_ext_failed", False)
    with caplog.at_level("WARNING", logger=adam_mod.__name__):
        assert kernel_backend() == "fused"  # torch's fused AdamW: no compiler needed
        assert kernel_backend(torch.float32) == "fused"
        g = torch.ones(16, dtype=torch.bfloat16)
        master = torch.zeros(16)
        adamw_(master, torch.zeros(16), torch.zeros(16), g, g, [AdamSegment(0, 16, 1, 0.1, 0.0)],
               beta1=0.9, beta2=0.999, eps=1e-8)  # fmt: skip
    assert torch.allclose(master, torch.full((16,), -0.1))  # first Adam step moves by lr
    assert torch.equal(g, master.to(torch.bfloat16))
    warnings = [
        r for r in caplog.records if r.levelname == "WARNING" and r.name == adam_mod.__name__
    ]
    assert len(warnings) == 1
    assert "fused AdamW" in warnings[0].getMessage()
    monkeypatch.setenv("PSTAR_ADAM_BACKEND", "cpp")
    with pytest.raises(RuntimeError, match="failed to build"):
        kernel_backend()


@pytest.mark.parametrize(("cpp", "expected"), [(1.2e9, "cpp"), (1.04e9, "fused")])
def test_the_host_kernel_is_ours_only_where_it_wins_by_a_clear_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpp: float, expected: str
) -> None:
    monkeypatch.setenv("PSTAR_EXT_DIR", str(tmp_path))
    monkeypatch.delenv("PSTAR_ADAM_BACKEND", raising=False)
    monkeypatch.setattr(adam_mod, "_load_ext", lambda: object())  # "built"
    calls = []

    def measured(numel, dtype, backends, repeats=5):
        calls.append(dtype)
        return {"cpp": cpp, "fused": 1.0e9}

    monkeypatch.setattr(adam_mod, "measure_backends", measured)
    assert not adam_mod.prepared(threads=1)
    out = adam_mod.prepare([1])
    assert adam_mod.prepared(threads=1)
    assert {k: v["backend"] for k, v in out["choices"].items()} == {
        "bf16/1": expected,
        "fp32/1": expected,
    }
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert kernel_backend(torch.bfloat16) == expected
    # kept on disk: a second process (here: a cleared cache) measures nothing again
    monkeypatch.setattr(adam_mod, "_choices", {})
    n = len(calls)
    assert kernel_backend(torch.float32) == expected
    assert len(calls) == n


def test_measuring_the_backends_times_the_real_kernels() -> None:
    rates = adam_mod.measure_backends(1 << 16, torch.bfloat16, ["fused", "torch"], repeats=2)
    assert set(rates) == {"fused", "torch"}
    assert all(r > 0 for r in rates.values())
