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
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import elastic_kernels
from elastic_kernels import paged_linear as pl
from elastic_kernels import paged_linear_reference as ref

K_RULE = 2.0
U = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
LOW = (torch.bfloat16, torch.float16)

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


def make_problem(case, dtype, device="cpu", *, bias=True, lora=True, seed=0) -> Problem:
    t, k, n, r, rpc, layout = case
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    p = Problem(T=t, K=k, N=n, r=r if lora else 0, dtype=dtype, scale=0.75)
    p.x = rnd(t, k)
    p.weight = rnd(n, k, scale=k**-0.5)
    p.chunks = make_chunks(p.weight, rpc, layout, seed)
    p.bias = rnd(n) if bias else None
    if lora:
        p.lora_a = rnd(r, k, scale=k**-0.5)
        p.lora_b = rnd(n, r, scale=r**-0.5)
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


def grad_inputs(p):
    """(lora_x, xa, dy, dyb) in the problem's dtype: independent random xa / dyb, so the adapter
    gradients are checked on their own, not through the other ops."""
    gen = torch.Generator().manual_seed(7)
    xa = torch.randn(p.T, p.r, generator=gen, dtype=torch.float64).to(p.dtype).to(p.x.device)
    dyb = torch.randn(p.T, p.r, generator=gen, dtype=torch.float64).to(p.dtype).to(p.x.device)
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


def check_fwd(p, impl):
    y, xa = pl.paged_lora_linear_fwd(p.x, p.chunks, p.bias, p.lora_x, p.lora_a, p.lora_b, p.scale, impl=impl)
    assert y.dtype == p.dtype and xa.dtype == p.dtype
    assert xa.shape == (p.T, p.r)
    y_ex, mag, xa_ex, xa_mag = exact_fwd(p)
    if p.dtype in LOW:
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
    assert dx.dtype == p.dtype and dyb.dtype == p.dtype
    assert dyb.shape == (p.T, p.r)
    dx_ex, mag, dyb_ex, dyb_mag = exact_dgrad(p)
    if p.dtype in LOW:
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
    assert ga.dtype == p.dtype and gb.dtype == p.dtype
    ga_ex, gb_ex, mag_a, mag_b = exact_grads(p, lora_x, xa, dy, dyb)
    if p.dtype in LOW:
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
    return {
        "fwd-lora-bias": (torch.ops.elastic.paged_lora_linear_fwd.default,
                          (p.x, p.chunks, p.bias, p.lora_x, p.lora_a, p.lora_b, p.scale)),
        "fwd-lora_x-none": (torch.ops.elastic.paged_lora_linear_fwd.default,
                            (p.x, p.chunks, None, None, p.lora_a, p.lora_b, p.scale)),
        "fwd-plain": (torch.ops.elastic.paged_lora_linear_fwd.default, (q.x, q.chunks, None, None, None, None, 1.0)),
        "dgrad-lora": (torch.ops.elastic.paged_lora_linear_dgrad.default, (p.dy, p.chunks, p.lora_a, p.lora_b, p.scale)),
        "dgrad-plain": (torch.ops.elastic.paged_lora_linear_dgrad.default, (q.dy, q.chunks, None, None, 1.0)),
        "adapter-grads": (torch.ops.elastic.lora_adapter_grads.default, (lx, xa, dy, dyb, p.scale)),
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

    return {
        "dy width": (dgrad(dy=torch.randn(5, 9)), ValueError, r"dy has 9 columns but the chunks hold 10 rows"),
        "chunks dtype": (dgrad(dy=base.dy.half()), TypeError, r"chunks\[0\] has dtype torch.float32, but dy"),
        "lora_a K": (dgrad(lora_a=torch.randn(2, 7)), ValueError, r"lora_a has 7 columns but the weight has K = 8"),
        "rank": (dgrad(lora_a=torch.randn(3, 8)), ValueError, r"lora_b has 2 columns but lora_a has r = 3"),
        "lora_b device": (dgrad(lora_b=base.lora_b.to("meta")), ValueError, r"lora_b is on meta, but dy is on cpu"),
    }


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
    }


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
