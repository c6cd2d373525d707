"""Paged LoRA linear ops: Triton kernels (interpreter on CPU, compiled on GPU) and the pure-torch
reference, each against float64 dense math.

Tolerances
- fp32 / fp64: the standard worst-case bound of a dot product of n terms computed in working
  precision with unit roundoff u, |fl(Σ aᵢbᵢ) − Σ aᵢbᵢ| ≤ n·u/(1 − n·u) · Σ|aᵢbᵢ|, elementwise,
  with n = (reduction length) + r + 4: the LoRA product adds r terms, and the rounding of
  xa/dyb, of the scale, of the bias add and of the output add one u each. `mag` below is the
  Σ|aᵢbᵢ| of each output element, computed in float64 from the absolute values. No slack
  factor beyond that: the bound holds for any summation order (tiles, split-K, BLAS).
- bf16 / fp16 (CONVENTIONS.md): the max error against float64 must be at most K_RULE = 2 times
  the max error of eager PyTorch in the same precision on the same inputs (eager rounds the base
  product, the LoRA product, the scale and the sum separately, the kernels round once; 2 leaves
  room for a different summation order). When eager happens to be exact the floor is half an
  ulp of the largest output, the error of rounding the exact result once.
- fp32 adapters with bf16 / fp16 activations (`assert_mixed_bound`): a bound derived from the
  unit roundoffs, elementwise, no k-rule needed because the op rounds to 16 bits exactly once.
  xa, dyb, dA and dB are fp32 outputs computed from exactly representable inputs (a 16-bit
  value is exact in fp32) with fp32 products and sums: the fp32 bound above holds as is, and
  it also proves they were not rounded to 16 bits on the way (that alone costs up to 2^-8
  (bf16) or 2^-11 (fp16) relative, 10^2-10^3 times the bound at these shapes). y and dx: the
  kernel forms ŷ in fp32, with
  |ŷ − y| ≤ e₃₂ = γ_n(2^-24)·mag + 3·2^-22·lora_mag, where lora_mag = s·(|lx|·|A|ᵀ)·|B|ᵀ is the
  Σ|·| of the LoRA term alone and 3·2^-22 is the relative error of one product done as
  tf32x3 (the GPU kernels' fused LoRA term, [Note: adapter dtype in the kernels]: each fp32
  operand split into two TF32 parts with error ≤ 2^-22 relative, plus the dropped lo·lo term;
  on CPU the products are fp32 and this term is slack); n = (reduction) + 3r + 4, the 3r
  because tf32x3 sums three partial products per LoRA term. Then it rounds once to 16 bits:
  |fl₁₆(ŷ) − ŷ| ≤ u₁₆·|ŷ| + η, with u₁₆ = eps/2 (2^-8 bf16, 2^-11 fp16) and η = half the
  spacing of subnormals (fp16 only matters). Together: |out − y| ≤ u₁₆·|y| + (1 + u₁₆)·e₃₂ + η.
  Rounding xa to 16 bits inside y would add up to u₁₆·lora_mag, which
  `test_fp32_adapters_lora_term_rounded_once` makes visible (W = 0, rank 1).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import elastic_kernels
from elastic_kernels.ops import paged_linear as pl, register_triton_ops

# The tests reach the Triton ops as torch.ops.elastic.*, which exist once registered: they register
# on first need ([Note: Triton ops register lazily] in elastic_kernels/ops/_lazy.py).
register_triton_ops()

K_RULE = 2.0
U = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
LOW = (torch.bfloat16, torch.float16)
U_TF32X3 = 3 * 2.0**-22  # relative error of one fp32 product done as tf32x3 (module docstring)

# (T, K, N, r, rows_per_chunk, layout). Every value of {1, 7, 64, 127, 130} appears as tokens,
# in_features and out_features; rows_per_chunk divides N (64/16), does not (130/32, 127/50),
# is 1 (127 chunks of one row) or gives a single chunk (N=1, N=7, 64/64). "pool" chunks are
# views of one buffer with the pages in a shuffled order (so page offsets are negative and
# non-monotonic); "separate" chunks are separate allocations.
CASES = [
    (1, 7, 64, 1, 16, "pool"),
    (7, 64, 127, 8, 1, "separate"),
    (64, 127, 130, 16, 32, "pool"),
    (127, 130, 1, 8, 1, "separate"),
    (130, 1, 7, 16, 7, "pool"),
    (64, 64, 64, 16, 64, "separate"),
    (130, 130, 127, 1, 50, "pool"),
]
CASE_IDS = [f"T{c[0]}-K{c[1]}-N{c[2]}-r{c[3]}-rpc{c[4]}-{c[5]}" for c in CASES]
# The low-precision runs take the cases with the longest reductions and ragged tiles.
LOW_CASES = [CASES[i] for i in (2, 3, 6)]
LOW_IDS = [CASE_IDS[i] for i in (2, 3, 6)]
# fp32 adapters with 16-bit activations: small ragged shapes (the interpreter's tiles are 32
# wide: K=33 / N=40 / T=34 cross one tile boundary), several chunk sizes (dividing N, not
# dividing it, one chunk, one row per chunk), ranks 1..16, and one case with every EVEN_* flag on.
MIXED_CASES = [
    (7, 33, 40, 4, 8, "pool"),
    (7, 40, 33, 8, 5, "separate"),
    (34, 33, 40, 16, 40, "separate"),  # T over two row tiles; the token reduction of dA/dB splits
    (7, 64, 64, 16, 16, "pool"),  # K, N, r multiples of the tiles: the unmasked branches
    (1, 33, 7, 1, 1, "pool"),  # one token, rank 1, one row per chunk
]
MIXED_IDS = [f"T{c[0]}-K{c[1]}-N{c[2]}-r{c[3]}-rpc{c[4]}-{c[5]}" for c in MIXED_CASES]


# ---------------------------------------------------------------------------------------------
# Problem construction
# ---------------------------------------------------------------------------------------------


def make_chunks(weight: torch.Tensor, rows_per_chunk: int, layout: str, seed: int = 0) -> list[torch.Tensor]:
    n, k = weight.shape
    pieces = [weight[i : i + rows_per_chunk] for i in range(0, n, rows_per_chunk)]
    if layout == "separate":
        return [p.clone() for p in pieces]
    assert layout == "pool"
    pages = len(pieces) + 1  # one spare page: the pool is not exactly the weight
    pool = torch.full((pages, rows_per_chunk * k), float("nan"), dtype=weight.dtype, device=weight.device)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages, generator=gen).tolist()
    chunks = []
    for page, p in zip(order, pieces):
        view = pool[page, : p.numel()].view(p.shape[0], k)
        view.copy_(p)
        chunks.append(view)
    return chunks


class Problem(types.SimpleNamespace):
    pass


def make_problem(case, dtype, device="cpu", *, bias=True, lora=True, seed=0, adapter_dtype=None) -> Problem:
    """A problem with activations, W and bias in `dtype` and the adapters (so xa / dyb) in
    `adapter_dtype` (default: `dtype`)."""
    t, k, n, r, rpc, layout = case
    gen = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt).to(device)

    p = Problem(T=t, K=k, N=n, r=r if lora else 0, dtype=dtype, adapter_dtype=adapter_dtype, scale=0.75)
    p.x = rnd(t, k)
    p.weight = rnd(n, k, scale=k**-0.5)
    p.chunks = make_chunks(p.weight, rpc, layout, seed)
    p.bias = rnd(n) if bias else None
    if lora:
        p.lora_a = rnd(r, k, scale=k**-0.5, dt=adapter_dtype)
        p.lora_b = rnd(n, r, scale=r**-0.5, dt=adapter_dtype)
        keep = torch.rand(t, k, generator=gen) > 0.25  # dropout(x) as the caller passes it
        p.lora_x = (p.x.double().cpu() * keep / 0.75).to(dtype).to(device)
    else:
        p.lora_a = p.lora_b = p.lora_x = None
    p.dy = rnd(t, n)
    return p


def d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def exact_fwd(p):
    y = d(p.x) @ d(p.weight).t()
    mag = d(p.x).abs() @ d(p.weight).abs().t()
    if p.bias is not None:
        y = y + d(p.bias)
        mag = mag + d(p.bias).abs()
    xa = None
    if p.lora_a is not None:
        xa = d(p.lora_x) @ d(p.lora_a).t()
        y = y + p.scale * xa @ d(p.lora_b).t()
        mag = mag + p.scale * (d(p.lora_x).abs() @ d(p.lora_a).abs().t()) @ d(p.lora_b).abs().t()
    return y, mag, xa, d(p.lora_x).abs() @ d(p.lora_a).abs().t() if xa is not None else None


def exact_dgrad(p):
    dx = d(p.dy) @ d(p.weight)
    mag = d(p.dy).abs() @ d(p.weight).abs()
    dyb = None
    if p.lora_a is not None:
        dyb = d(p.dy) @ d(p.lora_b)
        dx = dx + p.scale * dyb @ d(p.lora_a)
        mag = mag + p.scale * (d(p.dy).abs() @ d(p.lora_b).abs()) @ d(p.lora_a).abs()
    return dx, mag, dyb, d(p.dy).abs() @ d(p.lora_b).abs() if dyb is not None else None


def lora_mag_fwd(p):
    """Σ|·| of the LoRA term of y alone: s·(|lx|·|A|ᵀ)·|B|ᵀ."""
    return p.scale * (d(p.lora_x).abs() @ d(p.lora_a).abs().t()) @ d(p.lora_b).abs().t()


def lora_mag_dgrad(p):
    """Σ|·| of the LoRA term of dx alone: s·(|dy|·|B|)·|A|."""
    return p.scale * (d(p.dy).abs() @ d(p.lora_b).abs()) @ d(p.lora_a).abs()


def is_mixed(p) -> bool:
    """Adapters (hence xa / dyb / dA / dB) in another dtype than the activations."""
    return p.r > 0 and p.adapter_dtype != p.dtype


def grad_inputs(p):
    """(lora_x, xa, dy, dyb): lora_x, dy in the problem's dtype, xa / dyb in its adapter dtype;
    independent random xa / dyb, so the adapter gradients are checked on their own, not through
    the other ops."""
    gen = torch.Generator().manual_seed(7)
    xa = torch.randn(p.T, p.r, generator=gen, dtype=torch.float64).to(p.adapter_dtype).to(p.x.device)
    dyb = torch.randn(p.T, p.r, generator=gen, dtype=torch.float64).to(p.adapter_dtype).to(p.x.device)
    return p.lora_x, xa, p.dy, dyb


def exact_grads(p, lora_x, xa, dy, dyb):
    s = p.scale
    ga = s * d(dyb).t() @ d(lora_x)
    gb = s * d(dy).t() @ d(xa)
    mag_a = s * d(dyb).abs().t() @ d(lora_x).abs()
    mag_b = s * d(dy).abs().t() @ d(xa).abs()
    return ga, gb, mag_a, mag_b


def eager_fwd(p):
    """The natural eager PyTorch of the forward, in the problem's dtype, W dense."""
    y = F.linear(p.x, p.weight, p.bias)
    xa = None
    if p.lora_a is not None:
        xa = F.linear(p.lora_x, p.lora_a)
        y = y + F.linear(xa, p.lora_b) * p.scale
    return y, xa


def eager_dgrad(p):
    dx = p.dy @ p.weight
    dyb = None
    if p.lora_a is not None:
        dyb = p.dy @ p.lora_b
        dx = dx + (dyb @ p.lora_a) * p.scale
    return dx, dyb


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def assert_bound(out: torch.Tensor, exact: torch.Tensor, mag: torch.Tensor, n_terms: int, what: str):
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    u = U[out.dtype]
    n = n_terms + 4
    bound = (n * u / (1 - n * u)) * mag
    err = (d(out).cpu() - exact.cpu()).abs()
    bad = err > bound.cpu()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements over the {out.dtype} rounding bound; "
        f"worst err {err.max().item():.3g}, bound there {bound.cpu()[err == err.max()].min().item():.3g}"
    )


def assert_k_rule(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what: str):
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    assert out.dtype == eager.dtype
    exact = exact.cpu()
    err = (d(out).cpu() - exact).abs().max().item()
    err_eager = (d(eager).cpu() - exact).abs().max().item()
    floor = torch.finfo(out.dtype).eps / 2 * exact.abs().max().item()
    assert err <= K_RULE * max(err_eager, floor), (
        f"{what}: error {err:.3g} vs float64 exceeds {K_RULE} x eager {out.dtype} error {err_eager:.3g} "
        f"(floor {floor:.3g})"
    )


def assert_mixed_bound(
    out: torch.Tensor, exact: torch.Tensor, mag: torch.Tensor, lora_mag: torch.Tensor, n_terms: int, what: str
):
    """y / dx of an op with fp32 adapters and 16-bit activations (module docstring), or, for the
    reference, fp64 activations: then xa / dyb are rounded to fp32 (≤ 2^-24·lora_mag more, times
    1 + 2^-24 for the second-order terms) and everything else is fp64 arithmetic."""
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    n = n_terms + 4
    exact, mag, lora_mag = exact.cpu(), mag.cpu(), lora_mag.cpu()
    if out.dtype in LOW:
        fi = torch.finfo(out.dtype)
        u_out, eta = fi.eps / 2, fi.smallest_normal * fi.eps / 2
        u = U[torch.float32]
        e_acc = (n * u / (1 - n * u)) * mag + U_TF32X3 * lora_mag
        bound = u_out * exact.abs() + (1 + u_out) * e_acc + eta
    else:
        assert out.dtype == torch.float64
        u = U[torch.float64]
        bound = (1 + U[torch.float32]) * ((n * u / (1 - n * u)) * mag + U[torch.float32] * lora_mag)
    err = (d(out).cpu() - exact).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements over the {out.dtype}-output / fp32-adapter bound; "
        f"worst err {err.max().item():.3g}, bound there {bound[err == err.max()].min().item():.3g}"
    )


def check_fwd(p, impl):
    y, xa = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, p.lora_x, p.lora_a, p.lora_b, p.scale, impl=impl)
    assert y.dtype == p.dtype and xa.dtype == (p.adapter_dtype if p.r else p.dtype)
    assert xa.shape == (p.T, p.r)
    y_ex, mag, xa_ex, xa_mag = exact_fwd(p)
    if is_mixed(p):
        assert_mixed_bound(y, y_ex, mag, lora_mag_fwd(p), p.K + 3 * p.r, "y")
        assert_bound(xa, xa_ex, xa_mag, p.K, "xa")  # fp32 xa: the fp32 bound
    elif p.dtype in LOW:
        y_eager, xa_eager = eager_fwd(p)
        assert_k_rule(y, y_eager, y_ex, "y")
        if xa_ex is not None:
            assert_k_rule(xa, xa_eager, xa_ex, "xa")
    else:
        assert_bound(y, y_ex, mag, p.K + p.r, "y")
        if xa_ex is not None:
            assert_bound(xa, xa_ex, xa_mag, p.K, "xa")


def check_dgrad(p, impl):
    dx, dyb = pl.paged_lora_linear_dgrad(p.dy, p.chunks, p.lora_a, p.lora_b, p.scale, impl=impl)
    assert dx.dtype == p.dtype and dyb.dtype == (p.adapter_dtype if p.r else p.dtype)
    assert dyb.shape == (p.T, p.r)
    dx_ex, mag, dyb_ex, dyb_mag = exact_dgrad(p)
    if is_mixed(p):
        assert_mixed_bound(dx, dx_ex, mag, lora_mag_dgrad(p), p.N + 3 * p.r, "dx")
        assert_bound(dyb, dyb_ex, dyb_mag, p.N, "dyb")  # fp32 dyb: the fp32 bound
    elif p.dtype in LOW:
        dx_eager, dyb_eager = eager_dgrad(p)
        assert_k_rule(dx, dx_eager, dx_ex, "dx")
        if dyb_ex is not None:
            assert_k_rule(dyb, dyb_eager, dyb_ex, "dyb")
    else:
        assert_bound(dx, dx_ex, mag, p.N + p.r, "dx")
        if dyb_ex is not None:
            assert_bound(dyb, dyb_ex, dyb_mag, p.N, "dyb")


def check_grads(p, impl):
    lora_x, xa, dy, dyb = grad_inputs(p)
    ga, gb = pl.lora_adapter_grads(lora_x, xa, dy, dyb, p.scale, impl=impl)
    assert ga.dtype == p.adapter_dtype and gb.dtype == p.adapter_dtype
    ga_ex, gb_ex, mag_a, mag_b = exact_grads(p, lora_x, xa, dy, dyb)
    if is_mixed(p):  # fp32 dA / dB from exact inputs: the fp32 bound (fp32 also with fp64 lora_x)
        assert_bound(ga, ga_ex, mag_a, p.T, "dA")
        assert_bound(gb, gb_ex, mag_b, p.T, "dB")
    elif p.dtype in LOW:
        assert_k_rule(ga, (dyb.t() @ lora_x) * p.scale, ga_ex, "dA")
        assert_k_rule(gb, (dy.t() @ xa) * p.scale, gb_ex, "dB")
    else:
        assert_bound(ga, ga_ex, mag_a, p.T, "dA")
        assert_bound(gb, gb_ex, mag_b, p.T, "dB")


FWD_VARIANTS = {"bias+lora": (True, True), "plain": (False, False), "bias": (True, False), "lora": (False, True)}


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreter here, compiled on a GPU) and the reference, fp32 and fp64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(FWD_VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fwd_fp32(impl, case, variant):
    bias, lora = FWD_VARIANTS[variant]
    check_fwd(make_problem(case, torch.float32, bias=bias, lora=lora), impl)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "plain"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_dgrad_fp32(impl, case, lora):
    check_dgrad(make_problem(case, torch.float32, lora=lora), impl)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_adapter_grads_fp32(impl, case):
    check_grads(make_problem(case, torch.float32), impl)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_fp64(case):
    p = make_problem(case, torch.float64)
    check_fwd(p, "reference")
    check_dgrad(p, "reference")
    check_grads(p, "reference")


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", LOW_CASES, ids=LOW_IDS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_low_precision(impl, case, dtype):
    p = make_problem(case, dtype)
    check_fwd(p, impl)
    check_dgrad(p, impl)
    check_grads(p, impl)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", MIXED_CASES, ids=MIXED_IDS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp32_adapters(impl, case, dtype):
    """16-bit activations, fp32 adapters: y / dx in the 16-bit dtype, xa / dyb / dA / dB in fp32,
    each within the bound derived in the module docstring."""
    for bias in (True, False):
        check_fwd(make_problem(case, dtype, bias=bias, adapter_dtype=torch.float32), impl)
    p = make_problem(case, dtype, adapter_dtype=torch.float32)
    check_dgrad(p, impl)
    check_grads(p, impl)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp32_adapters_lora_term_rounded_once(impl):
    """W = 0 and no bias, rank 1: y = fl16(s·xa·bᵀ) and dx = fl16(s·dyb·a), so rounding xa or dyb
    to 16 bits before the LoRA term (which the contract forbids) would show as a double rounding.
    The same bound is checked to reject that double-rounded result, so this test can fail."""
    for dtype in LOW:
        p = make_problem((34, 33, 40, 1, 8, "pool"), dtype, bias=False, adapter_dtype=torch.float32)
        for c in p.chunks:
            c.zero_()
        p.weight = torch.zeros_like(p.weight)
        y, xa = pl.paged_lora_linear_fwd(p.x, p.chunks, None, p.lora_x, p.lora_a, p.lora_b, p.scale, impl=impl)
        dx, dyb = pl.paged_lora_linear_dgrad(p.dy, p.chunks, p.lora_a, p.lora_b, p.scale, impl=impl)
        y_ex, mag, xa_ex, _ = exact_fwd(p)
        dx_ex, mag_dx, dyb_ex, _ = exact_dgrad(p)
        assert_mixed_bound(y, y_ex, mag, lora_mag_fwd(p), p.K + 3 * p.r, "y")
        assert_mixed_bound(dx, dx_ex, mag_dx, lora_mag_dgrad(p), p.N + 3 * p.r, "dx")
        # What an op that rounded xa / dyb to 16 bits first would return, emulated exactly.
        y_bad = (p.scale * d(xa.to(dtype)) @ d(p.lora_b).t()).to(dtype)
        dx_bad = (p.scale * d(dyb.to(dtype)) @ d(p.lora_a)).to(dtype)
        with pytest.raises(AssertionError, match="over the"):
            assert_mixed_bound(y_bad, y_ex, mag, lora_mag_fwd(p), p.K + 3 * p.r, "y (xa rounded)")
        with pytest.raises(AssertionError, match="over the"):
            assert_mixed_bound(dx_bad, dx_ex, mag_dx, lora_mag_dgrad(p), p.N + 3 * p.r, "dx (dyb rounded)")


def test_fp32_adapters_without_lora_x():
    """lora_x=None with fp32 adapters: the LoRA branch reads the bf16 x itself."""
    p = make_problem(MIXED_CASES[0], torch.bfloat16, adapter_dtype=torch.float32)
    p.lora_x = p.x
    for impl in ("triton", "reference"):
        y, xa = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, None, p.lora_a, p.lora_b, p.scale, impl=impl)
        assert y.dtype == torch.bfloat16 and xa.dtype == torch.float32
        y_ex, mag, xa_ex, xa_mag = exact_fwd(p)
        assert_mixed_bound(y, y_ex, mag, lora_mag_fwd(p), p.K + 3 * p.r, f"y {impl}")
        assert_bound(xa, xa_ex, xa_mag, p.K, f"xa {impl}")


def test_reference_fp64_activations_fp32_adapters():
    """The contract's other allowed pair: fp32 adapters with fp64 activations (reference only, the
    Triton ops take no fp64): fp64 accumulation, xa / dyb / dA / dB rounded to fp32."""
    for case in MIXED_CASES[:2]:
        p = make_problem(case, torch.float64, adapter_dtype=torch.float32)
        check_fwd(p, "reference")
        check_dgrad(p, "reference")
        check_grads(p, "reference")


def test_triton_matches_reference_without_lora_x():
    """lora_x=None means the LoRA branch reads x itself (dropout 0)."""
    p = make_problem(CASES[2], torch.float32)
    p.lora_x = p.x
    y_t, xa_t = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, None, p.lora_a, p.lora_b, p.scale, impl="triton")
    y_r, xa_r = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, None, p.lora_a, p.lora_b, p.scale, impl="reference")
    y_ex, mag, xa_ex, xa_mag = exact_fwd(p)
    assert_bound(y_t, y_ex, mag, p.K + p.r, "y triton")
    assert_bound(y_r, y_ex, mag, p.K + p.r, "y reference")
    assert_bound(xa_t, xa_ex, xa_mag, p.K, "xa triton")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_strided_inputs(impl):
    """x / dy with a row stride wider than their width, and a transposed (column-major) x."""
    p = make_problem(CASES[6], torch.float32)
    wide = torch.zeros(p.T, p.K + 5)
    wide[:, 3 : 3 + p.K] = p.x
    p.x = wide[:, 3 : 3 + p.K]
    p.lora_x = p.lora_x.t().contiguous().t()
    wide_dy = torch.zeros(p.T, p.N + 9)
    wide_dy[:, : p.N] = p.dy
    p.dy = wide_dy[:, : p.N]
    assert not p.x.is_contiguous() and p.lora_x.stride(1) != 1 and not p.dy.is_contiguous()
    check_fwd(p, impl)
    check_dgrad(p, impl)
    check_grads(p, impl)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_no_tokens(impl):
    p = make_problem((0, 7, 9, 4, 4, "pool"), torch.float32)
    y, xa = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, p.lora_x, p.lora_a, p.lora_b, p.scale, impl=impl)
    assert y.shape == (0, 9) and xa.shape == (0, 4)
    dx, dyb = pl.paged_lora_linear_dgrad(p.dy, p.chunks, p.lora_a, p.lora_b, p.scale, impl=impl)
    assert dx.shape == (0, 7) and dyb.shape == (0, 4)
    ga, gb = pl.lora_adapter_grads(p.lora_x, xa, p.dy, dyb, p.scale, impl=impl)
    assert ga.shape == (4, 7) and gb.shape == (9, 4)
    assert not ga.any() and not gb.any()


def test_adapter_grads_split_reduction():
    """Enough tokens that the token reduction is split over programs (fp32 partials summed)."""
    p = make_problem((130, 64, 7, 8, 7, "separate"), torch.float32)
    check_grads(p, "triton")


# ---------------------------------------------------------------------------------------------
# Dispatch, page table, registration
# ---------------------------------------------------------------------------------------------


def test_auto_uses_reference_on_cpu(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("impl='auto' ran the Triton op on CPU tensors")

    for name in ("_paged_lora_linear_fwd_op", "_paged_lora_linear_dgrad_op", "_lora_adapter_grads_op"):
        monkeypatch.setattr(pl, name, boom)
    p = make_problem(CASES[0], torch.float32)
    check_fwd(p, "auto")
    check_dgrad(p, "auto")
    check_grads(p, "auto")


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setattr(pl, "INTERPRETED", False)
    p = make_problem(CASES[0], torch.float32)
    with pytest.raises(RuntimeError, match="x is on cpu: the Triton kernels need CUDA tensors"):
        pl.paged_lora_linear_fwd(p.x, p.chunks, impl="triton")


def test_page_table_offsets_and_alignment():
    w = torch.randn(10, 8)
    chunks = make_chunks(w, 3, "pool", seed=3)
    table, align = pl.page_table(chunks, 8)
    base = chunks[0].data_ptr()
    assert table.dtype == torch.int64
    assert table.tolist() == [(c.data_ptr() - base) // 4 for c in chunks]
    assert align == 4  # 16 bytes of fp32: pool rows of 8 elements keep every page aligned
    _, align = pl.page_table(make_chunks(torch.randn(10, 7), 3, "pool"), 7)
    assert align == 1  # rows of 7 fp32 elements: not 16-byte aligned


def test_page_table_rejects_misaligned_chunks():
    class Fake:
        device = torch.device("cpu")

        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr

        def element_size(self):
            return 4

    with pytest.raises(ValueError, match=r"chunks\[1\] starts 6 bytes from chunks\[0\]"):
        pl.page_table([Fake(4096), Fake(4102)], 8)


def test_ops_are_registered():
    names = set(elastic_kernels.registered_ops())
    assert {"paged_lora_linear_fwd", "paged_lora_linear_dgrad", "lora_adapter_grads"} <= names


def _opcheck_samples():
    p = make_problem((7, 40, 33, 4, 8, "pool"), torch.float32)
    q = make_problem((5, 16, 9, 2, 4, "separate"), torch.float32, bias=False, lora=False)
    lx, xa, dy, dyb = grad_inputs(p)
    m = make_problem((7, 33, 40, 4, 8, "pool"), torch.bfloat16, adapter_dtype=torch.float32)
    h = make_problem((5, 16, 9, 2, 4, "separate"), torch.float16, adapter_dtype=torch.float32)
    mlx, mxa, mdy, mdyb = grad_inputs(m)
    return {
        "fwd-lora-bias": (torch.ops.elastic.paged_lora_linear_fwd.default,
                          (p.x, p.chunks, p.bias, p.lora_x, p.lora_a, p.lora_b, p.scale)),
        "fwd-lora_x-none": (torch.ops.elastic.paged_lora_linear_fwd.default,
                            (p.x, p.chunks, None, None, p.lora_a, p.lora_b, p.scale)),
        "fwd-plain": (torch.ops.elastic.paged_lora_linear_fwd.default, (q.x, q.chunks, None, None, None, None, 1.0)),
        "dgrad-lora": (torch.ops.elastic.paged_lora_linear_dgrad.default, (p.dy, p.chunks, p.lora_a, p.lora_b, p.scale)),
        "dgrad-plain": (torch.ops.elastic.paged_lora_linear_dgrad.default, (q.dy, q.chunks, None, None, 1.0)),
        "adapter-grads": (torch.ops.elastic.lora_adapter_grads.default, (lx, xa, dy, dyb, p.scale)),
        # fp32 adapters with bf16 / fp16 activations: the fake impls must give xa / dyb / dA / dB
        # the adapter dtype.
        "fwd-bf16-fp32-adapters": (torch.ops.elastic.paged_lora_linear_fwd.default,
                                   (m.x, m.chunks, m.bias, m.lora_x, m.lora_a, m.lora_b, m.scale)),
        "fwd-fp16-fp32-adapters-lora_x-none": (torch.ops.elastic.paged_lora_linear_fwd.default,
                                               (h.x, h.chunks, None, None, h.lora_a, h.lora_b, h.scale)),
        "dgrad-bf16-fp32-adapters": (torch.ops.elastic.paged_lora_linear_dgrad.default,
                                     (m.dy, m.chunks, m.lora_a, m.lora_b, m.scale)),
        "adapter-grads-bf16-fp32": (torch.ops.elastic.lora_adapter_grads.default, (mlx, mxa, mdy, mdyb, m.scale)),
    }  # fmt: skip


@pytest.mark.parametrize("sample", list(_opcheck_samples()))
def test_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


def test_every_op_of_the_module_is_opchecked():
    checked = {op._schema.name.split("::")[1] for op, _ in _opcheck_samples().values()}
    defined = {op._name for op in pl.OPS}
    assert defined == checked


# ---------------------------------------------------------------------------------------------
# Bad input: every error names the argument at fault (both impls share the checks)
# ---------------------------------------------------------------------------------------------


def _bad_fwd_inputs():
    base = make_problem((5, 8, 10, 2, 4, "separate"), torch.float32)

    def fwd(**over):
        kw = dict(x=base.x, chunks=base.chunks, bias=base.bias, lora_x=base.lora_x, lora_a=base.lora_a,
                  lora_b=base.lora_b, scale=0.5)  # fmt: skip
        kw.update(over)
        return kw

    ch = base.chunks
    # x, chunks, bias and lora_x in bf16 (the activation dtype); adapters set per case.
    bf16 = dict(x=base.x.bfloat16(), chunks=[c.bfloat16() for c in ch], bias=base.bias.bfloat16(),
                lora_x=base.lora_x.bfloat16())  # fmt: skip
    return {
        "chunks dtype": (fwd(chunks=[c.double() for c in ch]), TypeError, r"chunks\[0\] has dtype torch.float64, but x"),
        "lora_a dtype": (fwd(lora_a=base.lora_a.half()), TypeError, r"lora_a has dtype torch.float16, but x"),
        "lora_b dtype": (fwd(lora_b=base.lora_b.double()), TypeError, r"lora_b has dtype torch.float64, but x"),
        "bias dtype": (fwd(bias=base.bias.half()), TypeError, r"bias has dtype torch.float16, but x"),
        "lora_x dtype": (fwd(lora_x=base.lora_x.double()), TypeError, r"lora_x has dtype torch.float64, but x"),
        "chunk K": (fwd(chunks=[ch[0], ch[1][:, :7].contiguous(), ch[2]]), ValueError,
                    r"chunks\[1\] has 7 columns but chunks\[0\] has 8"),
        "chunk rows": (fwd(chunks=[ch[0], ch[1][:3].contiguous(), ch[2]]), ValueError,
                       r"chunks\[1\] has 3 rows but rows_per_chunk is 4"),
        "last chunk rows": (fwd(chunks=[ch[0], torch.randn(6, 8)]), ValueError,
                            r"chunks\[1\] \(the last chunk\) has 6 rows; it must have 1\.\.4"),
        "non-contiguous chunk": (fwd(chunks=[ch[0], torch.randn(8, 4).t(), ch[2]]), ValueError,
                                 r"chunks\[1\] is not contiguous"),
        "rows vs lora_b": (fwd(chunks=ch[:2], bias=None), ValueError,
                           r"lora_b has 10 rows but the chunks hold 8 rows"),
        "rows vs bias": (fwd(chunks=ch[:2], lora_a=None, lora_b=None), ValueError,
                         r"bias has 10 elements but the chunks hold 8 rows"),
        "x K": (fwd(x=torch.randn(5, 9), lora_x=None), ValueError, r"chunks\[0\] has 8 columns but x has 9 features"),
        "lora_a K": (fwd(lora_a=torch.randn(2, 9)), ValueError, r"lora_a has 9 columns but the weight has K = 8"),
        "rank": (fwd(lora_b=torch.randn(10, 3)), ValueError, r"lora_b has 3 columns but lora_a has r = 2"),
        "zero rank": (fwd(lora_a=torch.randn(0, 8), lora_b=torch.randn(10, 0)), ValueError, r"rank r must be positive"),
        "one adapter": (fwd(lora_b=None), ValueError, r"lora_b is None but the other adapter is given"),
        "lora_x shape": (fwd(lora_x=torch.randn(4, 8)), ValueError, r"lora_x has shape \(4, 8\) but x has shape \(5, 8\)"),
        "empty chunks": (fwd(chunks=[]), ValueError, r"chunks is empty"),
        "chunks not a list": (fwd(chunks=base.weight), TypeError, r"chunks must be a list"),
        "x 1-D": (fwd(x=torch.randn(8)), ValueError, r"x must be 2-D"),
        "chunk device": (fwd(chunks=[ch[0], ch[1].to("meta"), ch[2]]), ValueError,
                         r"chunks\[1\] is on meta, but x is on cpu"),
        "lora_a device": (fwd(lora_a=base.lora_a.to("meta")), ValueError, r"lora_a is on meta, but x is on cpu"),
        # The adapter dtype is x's dtype or fp32, one dtype for both adapters.
        "bf16 adapters, fp32 x": (fwd(lora_a=base.lora_a.bfloat16(), lora_b=base.lora_b.bfloat16()), TypeError,
                                  r"lora_a has dtype torch.bfloat16, but x has dtype torch.float32; lora_a must have "
                                  r"x's dtype or torch.float32"),
        "fp16 adapters, bf16 x": (fwd(**bf16, lora_a=base.lora_a.half(), lora_b=base.lora_b.half()), TypeError,
                                  r"lora_a has dtype torch.float16, but x has dtype torch.bfloat16; lora_a must have "
                                  r"x's dtype or torch.float32"),
        "fp64 adapters, bf16 x": (fwd(**bf16, lora_a=base.lora_a.double(), lora_b=base.lora_b.double()), TypeError,
                                  r"lora_a has dtype torch.float64, but x has dtype torch.bfloat16"),
        "fp16 lora_b, bf16 x": (fwd(**bf16, lora_a=base.lora_a, lora_b=base.lora_b.half()), TypeError,
                                r"lora_b has dtype torch.float16, but x has dtype torch.bfloat16"),
        "fp32 lora_a, bf16 lora_b": (fwd(**bf16, lora_a=base.lora_a, lora_b=base.lora_b.bfloat16()), TypeError,
                                     r"lora_b has dtype torch.bfloat16, but lora_a has dtype torch.float32; the two "
                                     r"adapters must share one dtype"),
        "bf16 lora_a, fp32 lora_b": (fwd(**bf16, lora_a=base.lora_a.bfloat16(), lora_b=base.lora_b), TypeError,
                                     r"lora_b has dtype torch.float32, but lora_a has dtype torch.bfloat16"),
        "fp32 lora_x, bf16 x": (fwd(**dict(bf16, lora_x=base.lora_x)), TypeError,
                                r"lora_x has dtype torch.float32, but x has dtype torch.bfloat16"),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_bad_fwd_inputs()))
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_fwd_input(impl, name):
    kwargs, exc, msg = _bad_fwd_inputs()[name]
    with pytest.raises(exc, match=msg):
        pl.paged_lora_linear_fwd(**kwargs, impl=impl)


def _bad_dgrad_inputs():
    base = make_problem((5, 8, 10, 2, 4, "separate"), torch.float32)

    def dgrad(**over):
        kw = dict(dy=base.dy, chunks=base.chunks, lora_a=base.lora_a, lora_b=base.lora_b, scale=0.5)
        kw.update(over)
        return kw

    bf16 = dict(dy=base.dy.bfloat16(), chunks=[c.bfloat16() for c in base.chunks])

    return {
        "dy width": (dgrad(dy=torch.randn(5, 9)), ValueError, r"dy has 9 columns but the chunks hold 10 rows"),
        "chunks dtype": (dgrad(dy=base.dy.half()), TypeError, r"chunks\[0\] has dtype torch.float32, but dy"),
        "lora_a K": (dgrad(lora_a=torch.randn(2, 7)), ValueError, r"lora_a has 7 columns but the weight has K = 8"),
        "rank": (dgrad(lora_a=torch.randn(3, 8)), ValueError, r"lora_b has 2 columns but lora_a has r = 3"),
        "lora_b device": (dgrad(lora_b=base.lora_b.to("meta")), ValueError, r"lora_b is on meta, but dy is on cpu"),
        "fp16 adapters, bf16 dy": (dgrad(**bf16, lora_a=base.lora_a.half(), lora_b=base.lora_b.half()), TypeError,
                                   r"lora_a has dtype torch.float16, but dy has dtype torch.bfloat16; lora_a must have "
                                   r"dy's dtype or torch.float32"),
        "fp64 adapters, fp16 dy": (dgrad(dy=base.dy.half(), chunks=[c.half() for c in base.chunks],
                                         lora_a=base.lora_a.double(), lora_b=base.lora_b.double()), TypeError,
                                   r"lora_a has dtype torch.float64, but dy has dtype torch.float16"),
        "fp32 lora_a, bf16 lora_b": (dgrad(**bf16, lora_b=base.lora_b.bfloat16()), TypeError,
                                     r"lora_b has dtype torch.bfloat16, but lora_a has dtype torch.float32"),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_bad_dgrad_inputs()))
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_dgrad_input(impl, name):
    kwargs, exc, msg = _bad_dgrad_inputs()[name]
    with pytest.raises(exc, match=msg):
        pl.paged_lora_linear_dgrad(**kwargs, impl=impl)


def _bad_grad_inputs():
    lx, xa, dy, dyb = torch.randn(5, 8), torch.randn(5, 2), torch.randn(5, 10), torch.randn(5, 2)
    return {
        "xa tokens": ((lx, xa[:4], dy, dyb), ValueError, r"xa has 4 rows \(tokens\) but lora_x has 5"),
        "dy tokens": ((lx, xa, dy[:3], dyb), ValueError, r"dy has 3 rows \(tokens\) but lora_x has 5"),
        "rank": ((lx, xa, dy, torch.randn(5, 3)), ValueError, r"dyb has 3 columns but xa has r = 2"),
        "zero rank": ((lx, xa[:, :0], dy, dyb[:, :0]), ValueError, r"xa has 0 columns"),
        "dtype": ((lx, xa.double(), dy, dyb), TypeError, r"xa has dtype torch.float64, but lora_x"),
        "device": ((lx, xa, dy.to("meta"), dyb), ValueError, r"dy is on meta, but lora_x is on cpu"),
        # xa / dyb: the adapter dtype (lora_x's or fp32, one for both); dy: lora_x's dtype.
        "fp16 xa, bf16 lora_x": ((lx.bfloat16(), xa.half(), dy.bfloat16(), dyb.half()), TypeError,
                                 r"xa has dtype torch.float16, but lora_x has dtype torch.bfloat16; xa must have "
                                 r"lora_x's dtype or torch.float32"),
        "fp64 xa, bf16 lora_x": ((lx.bfloat16(), xa.double(), dy.bfloat16(), dyb.double()), TypeError,
                                 r"xa has dtype torch.float64, but lora_x has dtype torch.bfloat16"),
        "bf16 dyb, fp32 xa": ((lx.bfloat16(), xa, dy.bfloat16(), dyb.bfloat16()), TypeError,
                              r"dyb has dtype torch.bfloat16, but xa has dtype torch.float32; they must match"),
        "fp32 dy, bf16 lora_x": ((lx.bfloat16(), xa, dy, dyb), TypeError,
                                 r"dy has dtype torch.float32, but lora_x has dtype torch.bfloat16"),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_bad_grad_inputs()))
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_adapter_grad_input(impl, name):
    args, exc, msg = _bad_grad_inputs()[name]
    with pytest.raises(exc, match=msg):
        pl.lora_adapter_grads(*args, 0.5, impl=impl)


def test_bad_impl_and_dtype():
    p = make_problem(CASES[0], torch.float64)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        pl.paged_lora_linear_fwd(p.x, p.chunks, impl="cuda")
    with pytest.raises(TypeError, match=r"x has dtype torch.float64; the Triton kernels support"):
        pl.paged_lora_linear_fwd(p.x, p.chunks, impl="triton")
    with pytest.raises(TypeError, match=r"dy has dtype torch.float64; the Triton kernels support"):
        pl.paged_lora_linear_dgrad(p.dy, p.chunks, impl="triton")
    with pytest.raises(TypeError, match=r"lora_x has dtype torch.float64; the Triton kernels support"):
        pl.lora_adapter_grads(*grad_inputs(p), impl="triton")


# ---------------------------------------------------------------------------------------------
# GPU: the same checks with CUDA tensors (compiled Triton), and a large bf16 problem
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_kernels(case, dtype):
    for bias, lora in FWD_VARIANTS.values():
        p = make_problem(case, dtype, "cuda", bias=bias, lora=lora)
        check_fwd(p, "auto")
    for lora in (True, False):
        check_dgrad(make_problem(case, dtype, "cuda", lora=lora), "auto")
    check_grads(make_problem(case, dtype, "cuda"), "auto")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2048, 4096, 4096, 128), (1031, 4096, 11008, 96), (2048, 11008, 4096, 256)],
    ids=["2048x4096x4096-1MiB", "1031x4096x11008-ragged", "2048x11008x4096-5.4MiB"],
)
def test_gpu_large_bf16(shape):
    """Autotuned kernels on large shapes (rows_per_chunk = whole rows of about 1-5 MiB)."""
    t, k, n, rpc = shape
    p = make_problem((t, k, n, 16, rpc, "pool"), torch.bfloat16, "cuda")
    check_fwd(p, "auto")
    check_dgrad(p, "auto")
    check_grads(p, "auto")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", MIXED_CASES + [(1031, 4096, 4096, 16, 128, "pool")],
                         ids=MIXED_IDS + ["T1031-K4096-N4096-r16-rpc128-pool"])  # fmt: skip
def test_gpu_fp32_adapters(case, dtype):
    """Compiled kernels with fp32 adapters: the fused LoRA terms in tf32x3, the large case
    autotuned; the bound of the module docstring covers the tf32x3 products."""
    p = make_problem(case, dtype, "cuda", adapter_dtype=torch.float32)
    check_fwd(p, "auto")
    check_dgrad(p, "auto")
    check_grads(p, "auto")


@pytest.mark.gpu
def test_gpu_opcheck_and_side_stream():
    for op, args in _opcheck_samples().values():
        args = tuple([a.cuda() for a in x] if isinstance(x, list) else x.cuda() if torch.is_tensor(x) else x for x in args)
        torch.library.opcheck(op, args)
    p = make_problem(CASES[2], torch.bfloat16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y, _ = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, p.lora_x, p.lora_a, p.lora_b, p.scale)
    torch.cuda.current_stream().wait_stream(side)
    y_eager, _ = eager_fwd(p)
    assert_k_rule(y, y_eager, exact_fwd(p)[0], "y on a side stream")


@pytest.mark.gpu
def test_gpu_rejects_cuda_graph_capture_and_mixed_devices():
    p = make_problem(CASES[2], torch.bfloat16, "cuda")
    pl.paged_lora_linear_fwd(p.x, p.chunks)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph):
            pl.paged_lora_linear_fwd(p.x, p.chunks)
    with pytest.raises(ValueError, match=r"chunks\[0\] is on cpu, but x is on cuda"):
        pl.paged_lora_linear_fwd(p.x, [c.cpu() for c in p.chunks])


# ---------------------------------------------------------------------------------------------
# Compiled code, without a GPU: the kernels compile for sm_90a and the hot ones keep the
# properties the performance notes rely on
# ---------------------------------------------------------------------------------------------


def test_kernels_compile_for_sm90():
    """Compile every kernel variant for sm_90a (no GPU needed: Triton's own ptxas) in a fresh
    process without TRITON_INTERPRET, and check the bf16 paged GEMMs: wgmma tensor-core MMAs,
    16-byte cp.async tile loads (the page-table row gathers vectorised) and no register spills."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_aot_compile.py")
    out = subprocess.run([sys.executable, script, "--arch", "90", "--json"], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    gemms = [r for r in rows if r["kernel"].startswith(("fwd bf16", "dgrad bf16"))]
    assert len(gemms) == 2 * (len(pl._GEMM_CONFIGS) + len(pl._DGRAD_CONFIGS))
    for r in gemms:
        assert r["wgmma"] > 0, r
        assert r["cp_async_16B"] > 0, r
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 227 * 1024, r


_MIXED_AOT_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.kernels import _aot_compile as aot
from elastic_kernels.ops import paged_linear as pl

rows = []
def add(name, kernel, types, meta, nw, ns):
    row = aot._report(name, aot._compile(kernel, types, meta, 90, nw, ns), 90)
    rows.append(row)

lora_ptrs = {"fwd": ("xa_ptr", "b_ptr"), "dgrad": ("dyb_ptr", "a_ptr")}
for kind, kernel, configs in (("fwd", pl._paged_linear_fwd_kernel, pl._GEMM_CONFIGS),
                              ("dgrad", pl._paged_linear_dgrad_kernel, pl._DGRAD_CONFIGS)):
    for cfg in configs:
        types = aot.gemm_types(kind, "bf16")
        types.update({ptr: "*fp32" for ptr in lora_ptrs[kind]})
        meta = dict(cfg.kwargs, BLOCK_K=64, BLOCK_R=16, W_ALIGN=8, DOT_PRECISION="tf32", UPCAST_DOT=False,
                    HAS_LORA=True, EVEN_R=True)
        meta.update(dict(HAS_BIAS=True, EVEN_K=True) if kind == "fwd" else dict(EVEN_N=True, EVEN_OUT=True))
        add(f"{kind} bf16+fp32 {cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']} w{cfg.num_warps}", kernel, types,
            meta, cfg.num_warps, cfg.num_stages)
small = dict(pl._SMALL_GEMM)
nw, ns = small.pop("num_warps"), small.pop("num_stages")
for kind, kernel in (("fwd", pl._paged_linear_fwd_kernel), ("dgrad", pl._paged_linear_dgrad_kernel)):
    types = aot.gemm_types(kind, "fp16")
    types.update({ptr: "*fp32" for ptr in lora_ptrs[kind]})
    meta = dict(small, BLOCK_K=64, BLOCK_R=16, W_ALIGN=1, DOT_PRECISION="tf32", UPCAST_DOT=False, HAS_LORA=True,
                EVEN_R=False)
    meta.update(dict(HAS_BIAS=True, EVEN_K=False) if kind == "fwd" else dict(EVEN_N=False, EVEN_OUT=False))
    add(f"{kind} fp16+fp32 64x64 ragged", kernel, types, meta, nw, ns)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
down = {"a_ptr": "*bf16", "b_ptr": "*fp32", "out_ptr": "*fp32", "T": "i32", "L": "i32", "R": "i32",
        "stride_at": "i32", "stride_bl": "i32", "stride_bj": "i32", "stride_ot": "i32"}
for even in (True, False):
    meta = dict(EVEN_L=even, EVEN_R=even, DOT_PRECISION="tf32", UPCAST_DOT=False, BLOCK_M=64, BLOCK_L=128, BLOCK_R=16)
    add(f"lora_down bf16+fp32 even={even}", pl._lora_down_kernel, down, meta, 4, 3)
for a, b in (("fp32", "bf16"), ("bf16", "fp32")):  # dA = dyb^T lora_x, dB = dy^T xa
    types = {"a_ptr": f"*{a}", "b_ptr": f"*{b}", "out_ptr": "*fp32", "T": "i32", "M": "i32", "P": "i32",
             "stride_at": "i32", "stride_bt": "i32", "tokens_per_split": "i32", "scale": "fp32"}
    block_t = pl._lora_grad_block_t(DTYPES[a], DTYPES[b])  # the host's choice for this pair
    for bm, bp in ((16, 128), (128, 16)):
        meta = dict(DOT_PRECISION="tf32", UPCAST_DOT=False, BLOCK_M=bm, BLOCK_P=bp, BLOCK_T=block_t)
        add(f"lora_grad {a}x{b} {bm}x{bp} t{block_t}", pl._lora_grad_kernel, types, meta, 4, 3)
print(json.dumps(rows))
"""


def test_fp32_adapter_kernels_compile_for_sm90():
    """The fp32-adapter variants of every kernel (bf16 / fp16 activations, fp32 xa / dyb / adapters)
    compile for sm_90a without a GPU ([Note: adapter dtype in the kernels]): the paged GEMMs keep
    their wgmma main loop and 16-byte tile loads, and no variant spills. An "ieee" fp32 dot for
    the fused LoRA term spilled 2552 bytes per thread in the 128x256 forward (Triton 3.8), which
    is why the fused GEMMs use tf32x3 there."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _MIXED_AOT_SCRIPT, root], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == len(pl._GEMM_CONFIGS) + len(pl._DGRAD_CONFIGS) + 2 + 2 + 4
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 227 * 1024, r
        if r["kernel"].startswith(("fwd bf16", "dgrad bf16")):
            assert r["wgmma"] > 0, r
            assert r["cp_async_16B"] > 0, r
