"""Segmented multi-LoRA ops: the Triton kernels (interpreter on CPU, compiled on a GPU) and the
pure-torch reference, each against an independent float64 loop of plain per-adapter F.linear
(one PEFT-style LoRA branch per adapter, ``F.linear(F.linear(lx, A_k), B_k) * s_k``), whose
backward is float64 autograd.

Tolerances (the bounds of tests/kernels/test_paged_linear.py's docstring, reused):
- fp32 outputs (fp32 adapters, with fp32 or bf16 activations: a 16-bit value is exact in
  fp32): the worst-case dot-product bound γ_n·Σ|aᵢbᵢ| elementwise, u = 2^-24, with n the terms
  a result went through: delta and dx chain two products (xa / dyb over in / out terms, then r
  terms), so n = in + r (delta), out + r (dx); dA reduces over the segment's rows after dyb
  (n = out + T), dB over the rows with xa from the forward (rounded once to fp32 over `in`
  terms: n = in + T); assert_bound adds 4 for the roundings of the scale and of xa / dyb.
- bf16 adapters on bf16 activations (CONVENTIONS.md): the max error against float64 at most
  2x that of eager bf16 PyTorch on the same inputs (the per-adapter F.linear loop in bf16,
  which rounds xa, the product and the scaling separately; the op rounds once per output).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import elastic_kernels
from elastic_kernels.ops import register_triton_ops, segmented_lora as sl, segmented_lora_reference
from tests.kernels.test_paged_linear import assert_bound, assert_k_rule

# The tests reach the Triton ops as torch.ops.elastic.*, which exist once registered: they register
# on first need ([Note: Triton ops register lazily] in elastic_kernels/ops/_lazy.py).
register_triton_ops()

# (T, in, out, seg_offsets, ranks). The interpreter's tiles are 32 wide: in=33 / out=40 cross
# one tile boundary; segments of 47 rows span two row tiles; rank 40 spans two rank blocks.
CASES = {
    "K1": (47, 33, 40, [0, 47], [8]),
    "K2-empty-first": (47, 33, 40, [0, 0, 47], [4, 16]),
    "K4-empty-ranks": (47, 33, 40, [0, 13, 13, 40, 47], [1, 8, 40, 16]),
}
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "bf16-fp32-adapters": (torch.bfloat16, torch.float32)}  # fmt: skip


def make_problem(case, dtype, adapter_dtype, device="cpu", seed=0):
    t, k_in, n, offs, ranks = case
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt).to(device)

    p = types.SimpleNamespace(T=t, IN=k_in, OUT=n, offs=list(offs), ranks=list(ranks), dtype=dtype,
                              adapter_dtype=adapter_dtype)
    p.x = rnd(t, k_in)
    keep = torch.rand(t, k_in, generator=gen) > 0.25  # dropout(x) as the caller passes it
    p.lora_x = (p.x.double().cpu() * keep / 0.75).to(dtype).to(device)
    p.lora_a = [rnd(r, k_in, scale=k_in**-0.5, dt=adapter_dtype) for r in ranks]
    p.lora_b = [rnd(n, r, scale=r**-0.5, dt=adapter_dtype) for r in ranks]
    p.scales = [0.5 + 0.25 * k for k in range(len(ranks))]
    p.dy = rnd(t, n)
    return p


def d(t):
    return t.detach().to(torch.float64).cpu()


def exact(p):
    """float64 delta, xa, dx, dA, dB and their Σ|·| magnitudes: one plain F.linear LoRA branch
    per adapter on its rows, backward by autograd."""
    lx = d(p.lora_x).requires_grad_()
    a = [d(t).requires_grad_() for t in p.lora_a]
    b = [d(t).requires_grad_() for t in p.lora_b]
    r_max = max(p.ranks)
    delta = torch.zeros(p.T, p.OUT, dtype=torch.float64)
    xa = torch.zeros(p.T, r_max, dtype=torch.float64)
    mags = {n: torch.zeros(p.T, w, dtype=torch.float64) for n, w in (("delta", p.OUT), ("xa", r_max), ("dx", p.IN))}
    parts = []
    for k in range(len(p.ranks)):
        lo, hi, s = p.offs[k], p.offs[k + 1], p.scales[k]
        xk = F.linear(lx[lo:hi], a[k])
        parts.append((lo, hi, F.linear(xk, b[k]) * s))
        xa[lo:hi, : p.ranks[k]] = xk.detach()
        ax, aa, ab, ady = d(p.lora_x)[lo:hi].abs(), d(p.lora_a[k]).abs(), d(p.lora_b[k]).abs(), d(p.dy)[lo:hi].abs()
        mags["xa"][lo:hi, : p.ranks[k]] = ax @ aa.t()
        mags["delta"][lo:hi] = s * (ax @ aa.t()) @ ab.t()
        mags["dx"][lo:hi] = s * (ady @ ab) @ aa
    for lo, hi, part in parts:
        delta[lo:hi] = part.detach()
    loss = sum((part * d(p.dy)[lo:hi]).sum() for lo, hi, part in parts)
    grads = torch.autograd.grad(loss, [lx] + a + b, materialize_grads=True)
    k = len(p.ranks)
    dx, da, db = grads[0], list(grads[1 : 1 + k]), list(grads[1 + k :])
    mag_a, mag_b = [], []
    for j in range(k):
        lo, hi, s = p.offs[j], p.offs[j + 1], p.scales[j]
        ady, ax = d(p.dy)[lo:hi].abs(), d(p.lora_x)[lo:hi].abs()
        mag_a.append(s * (ady @ d(p.lora_b[j]).abs()).t() @ ax)
        mag_b.append(s * ady.t() @ (ax @ d(p.lora_a[j]).abs().t()))
    return types.SimpleNamespace(delta=delta, xa=xa, dx=dx, da=da, db=db, mags=mags, mag_a=mag_a, mag_b=mag_b)


def eager(p):
    """The natural eager PyTorch in the problem's dtypes: per adapter F.linear, as PEFT does."""
    delta = torch.empty(p.T, p.OUT, dtype=p.dtype)
    xa = torch.zeros(p.T, max(p.ranks), dtype=p.dtype)
    dx = torch.empty(p.T, p.IN, dtype=p.dtype)
    da, db = [], []
    for k in range(len(p.ranks)):
        lo, hi, s = p.offs[k], p.offs[k + 1], p.scales[k]
        xk = F.linear(p.lora_x[lo:hi], p.lora_a[k])
        xa[lo:hi, : p.ranks[k]] = xk
        delta[lo:hi] = F.linear(xk, p.lora_b[k]) * s
        dyb = p.dy[lo:hi] @ p.lora_b[k]
        dx[lo:hi] = (dyb @ p.lora_a[k]) * s
        da.append((dyb.t() @ p.lora_x[lo:hi]) * s)
        db.append((p.dy[lo:hi].t() @ xk) * s)
    return types.SimpleNamespace(delta=delta, xa=xa, dx=dx, da=da, db=db)


def check(p, impl):
    ex = exact(p)
    delta, xa = sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, p.lora_x, impl=impl)
    assert delta.dtype == p.adapter_dtype and xa.dtype == p.adapter_dtype
    assert delta.shape == (p.T, p.OUT) and xa.shape == (p.T, max(p.ranks))
    dx, da, db = sl.segmented_lora_bwd(p.dy, p.lora_x, xa, p.offs, p.lora_a, p.lora_b, p.scales, impl=impl)
    assert dx.dtype == p.adapter_dtype and dx.shape == (p.T, p.IN)
    assert [tuple(g.shape) for g in da] == [(r, p.IN) for r in p.ranks]
    assert [tuple(g.shape) for g in db] == [(p.OUT, r) for r in p.ranks]
    assert all(g.dtype == p.adapter_dtype for g in da + db)
    r = max(p.ranks)
    if p.adapter_dtype == torch.float32:
        assert_bound(xa, ex.xa, ex.mags["xa"], p.IN, "xa")
        assert_bound(delta, ex.delta, ex.mags["delta"], p.IN + r, "delta")
        assert_bound(dx, ex.dx, ex.mags["dx"], p.OUT + r, "dx")
        for k in range(len(p.ranks)):
            assert_bound(da[k], ex.da[k], ex.mag_a[k], p.OUT + p.T, f"dA[{k}]")
            assert_bound(db[k], ex.db[k], ex.mag_b[k], p.IN + p.T, f"dB[{k}]")
    else:
        eg = eager(p)
        assert_k_rule(xa, eg.xa, ex.xa, "xa")
        assert_k_rule(delta, eg.delta, ex.delta, "delta")
        assert_k_rule(dx, eg.dx, ex.dx, "dx")
        for k in range(len(p.ranks)):
            if p.offs[k] == p.offs[k + 1]:
                assert not da[k].any() and not db[k].any(), f"adapter {k} has no rows: its gradients are zero"
                continue
            assert_k_rule(da[k], eg.da[k], ex.da[k], f"dA[{k}]")
            assert_k_rule(db[k], eg.db[k], ex.db[k], f"dB[{k}]")
    # Rows of an adapter see only that adapter: xa is zero past each segment's rank.
    for k in range(len(p.ranks)):
        assert not xa[p.offs[k] : p.offs[k + 1], p.ranks[k] :].any()
    return delta, xa, dx, da, db


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_segmented_lora(impl, case, dtypes):
    check(make_problem(CASES[case], *DTYPES[dtypes]), impl)


def test_bound_rejects_a_wrong_adapter():
    """The checks can fail: giving a segment's rows the next adapter's B is caught."""
    p = make_problem(CASES["K4-empty-ranks"], torch.float32, torch.float32)
    wrong = list(p.lora_b)
    wrong[3] = p.lora_b[3].flip(0)  # adapter 3's rows [40, 47) meet a permuted B_3
    delta, _ = sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, wrong, p.scales, p.lora_x, impl="reference")
    ex = exact(p)
    with pytest.raises(AssertionError, match="over the"):
        assert_bound(delta, ex.delta, ex.mags["delta"], p.IN + 40, "delta")


def test_triton_matches_reference_without_lora_x():
    """lora_x=None: the LoRA input is x itself."""
    p = make_problem(CASES["K2-empty-first"], torch.float32, torch.float32)
    out_t = sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, impl="triton")
    out_r = sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, p.x, impl="reference")
    for a, b in zip(out_t, out_r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_no_rows(impl):
    """T = 0, every segment empty: empty outputs and zero gradients (an empty sum)."""
    p = make_problem((0, 8, 6, [0, 0, 0], [2, 3]), torch.float32, torch.float32)
    delta, xa = sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, impl=impl)
    assert delta.shape == (0, 6) and xa.shape == (0, 3)
    dx, da, db = sl.segmented_lora_bwd(p.dy, p.x, xa, p.offs, p.lora_a, p.lora_b, p.scales, impl=impl)
    assert dx.shape == (0, 8)
    assert [tuple(g.shape) for g in da] == [(2, 8), (3, 8)] and not any(g.any() for g in da + db)


def test_tile_table():
    assert sl.tile_table([0, 0, 70, 70, 75], 32) == ([1, 1, 1, 3], [0, 32, 64, 70])
    assert sl.tile_table([0, 0], 32) == ([], [])


def test_auto_uses_reference_on_cpu(monkeypatch):
    p = make_problem(CASES["K1"], torch.float32, torch.float32)

    def boom(*a, **k):
        raise AssertionError("the Triton op ran for CPU tensors under impl='auto'")

    monkeypatch.setattr(sl, "_segmented_lora_fwd_op", boom)
    sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales)


# ---------------------------------------------------------------------------------------------
# Registration: a fake impl and opcheck for each op (tests/kernels/test_op_coverage.py)
# ---------------------------------------------------------------------------------------------

OP_REFERENCES = {
    "segmented_lora_fwd": segmented_lora_reference.segmented_lora_fwd_reference,
    "segmented_lora_bwd": segmented_lora_reference.segmented_lora_bwd_reference,
}


def _opcheck_samples():
    p = make_problem((9, 16, 7, [0, 4, 4, 9], [2, 3, 1]), torch.float32, torch.float32)
    m = make_problem((9, 16, 7, [0, 5, 9], [2, 4]), torch.bfloat16, torch.float32)
    xa = segmented_lora_reference.segmented_lora_fwd_reference(p.x, p.offs, p.lora_a, p.lora_b, p.scales)[1]
    mxa = segmented_lora_reference.segmented_lora_fwd_reference(m.x, m.offs, m.lora_a, m.lora_b, m.scales, m.lora_x)[1]
    fwd, bwd = torch.ops.elastic.segmented_lora_fwd.default, torch.ops.elastic.segmented_lora_bwd.default
    return {
        "fwd-fp32": (fwd, (p.x, p.offs, p.lora_a, p.lora_b, p.scales, None)),
        "bwd-fp32": (bwd, (p.dy, p.x, xa, p.offs, p.lora_a, p.lora_b, p.scales)),
        "fwd-bf16-fp32-adapters": (fwd, (m.x, m.offs, m.lora_a, m.lora_b, m.scales, m.lora_x)),
        "bwd-bf16-fp32-adapters": (bwd, (m.dy, m.lora_x, mxa, m.offs, m.lora_a, m.lora_b, m.scales)),
    }


@pytest.mark.parametrize("sample", list(_opcheck_samples()))
def test_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


def test_ops_are_registered():
    assert set(OP_REFERENCES) <= set(elastic_kernels.registered_ops())
    assert {op._name for op in sl.OPS} == {op._schema.name.split("::")[1] for op, _ in _opcheck_samples().values()}


# ---------------------------------------------------------------------------------------------
# Bad input: every error names the argument at fault (both impls share the checks)
# ---------------------------------------------------------------------------------------------


def _bad_inputs():
    p = make_problem(CASES["K2-empty-first"], torch.float32, torch.float32)
    a, b, s, o = p.lora_a, p.lora_b, p.scales, p.offs

    def fwd(**over):
        kw = dict(x=p.x, seg_offsets=o, lora_a=a, lora_b=b, scales=s, lora_x=None)
        kw.update(over)
        return kw

    return {
        "offsets not monotone": (fwd(seg_offsets=[0, 30, 20]), ValueError, r"seg_offsets is not non-decreasing"),
        "offsets not ending at T": (fwd(seg_offsets=[0, 10, 40]), ValueError, r"ends at 40 but there are 47 rows"),
        "offsets not starting at 0": (fwd(seg_offsets=[3, 10, 47]), ValueError, r"seg_offsets\[0\] is 3"),
        "offsets of another K": (fwd(seg_offsets=[0, 10, 20, 47]), ValueError, r"4 entries but there are 2 adapters"),
        "offsets a tensor": (fwd(seg_offsets=torch.tensor(o)), TypeError, r"seg_offsets must be a list of ints"),
        "offset a float": (fwd(seg_offsets=[0, 1.5, 47]), TypeError, r"seg_offsets\[1\] must be an int"),
        "K mismatch lora_b": (fwd(lora_b=b[:1]), ValueError, r"lora_b has 1 adapters but lora_a has 2"),
        "K mismatch scales": (fwd(scales=s + [1.0]), ValueError, r"scales has 3 entries but lora_a has 2"),
        "no adapters": (fwd(lora_a=[], lora_b=[], scales=[]), ValueError, r"lora_a is empty"),
        "lora_a a tensor": (fwd(lora_a=a[0]), TypeError, r"lora_a must be a list of K tensors"),
        "lora_a columns": (fwd(lora_a=[a[0][:, :5], a[1]]), ValueError, r"lora_a\[0\] has 5 columns but x has 33"),
        "rank mismatch": (fwd(lora_b=[b[0][:, :3], b[1]]), ValueError, r"lora_b\[0\] has 3 columns but lora_a\[0\] has r = 4"),
        "out_features differ": (fwd(lora_b=[b[0], b[1][:7]]), ValueError, r"lora_b\[1\] has 7 rows .* lora_b\[0\] has 40"),
        "scale nan": (fwd(scales=[1.0, float("nan")]), TypeError, r"scales\[1\] must be a finite float"),
        "adapter dtype": (fwd(lora_a=[t.double() for t in a], lora_b=[t.double() for t in b]), TypeError,
                          r"lora_a\[0\] has dtype torch.float64, but x has dtype torch.float32"),
        "adapters of two dtypes": (fwd(x=p.x.bfloat16(), lora_a=[a[0].bfloat16(), a[1]], lora_b=[b[0].bfloat16(), b[1]]),
                                   TypeError, r"every adapter must have one dtype"),
        "lora_x shape": (fwd(lora_x=p.x[:5]), ValueError, r"lora_x has shape \(5, 33\) but x has shape \(47, 33\)"),
        "adapter device": (fwd(lora_a=[a[0].to("meta"), a[1]]), ValueError, r"lora_a\[0\] is on meta, but x is on cpu"),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_bad_inputs()))
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_fwd_input(impl, name):
    kw, exc, msg = _bad_inputs()[name]
    with pytest.raises(exc, match=msg):
        sl.segmented_lora_fwd(**kw, impl=impl)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_bwd_input(impl):
    p = make_problem(CASES["K2-empty-first"], torch.float32, torch.float32)
    xa = torch.zeros(p.T, 16)
    args = (p.offs, p.lora_a, p.lora_b, p.scales)
    with pytest.raises(ValueError, match=r"xa has shape \(47, 8\) but segmented_lora_fwd returns \[T, max rank\] = \[47, 16\]"):
        sl.segmented_lora_bwd(p.dy, p.x, xa[:, :8], *args, impl=impl)
    with pytest.raises(TypeError, match=r"xa has dtype torch.bfloat16, but the adapters have torch.float32"):
        sl.segmented_lora_bwd(p.dy, p.x, xa.bfloat16(), *args, impl=impl)
    with pytest.raises(ValueError, match=r"dy has 5 rows but lora_x has 47"):
        sl.segmented_lora_bwd(p.dy[:5], p.x, xa, *args, impl=impl)
    with pytest.raises(ValueError, match=r"lora_b\[0\] has 40 rows \(out_features\) but dy has 9"):
        sl.segmented_lora_bwd(p.dy[:, :9], p.x, xa, *args, impl=impl)
    with pytest.raises(TypeError, match=r"dy has dtype torch.bfloat16, but lora_x has dtype torch.float32"):
        sl.segmented_lora_bwd(p.dy.bfloat16(), p.x, xa, *args, impl=impl)


def test_bad_impl_and_dtype():
    p = make_problem(CASES["K1"], torch.float64, torch.float64)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, impl="cuda")
    with pytest.raises(TypeError, match=r"x has dtype torch.float64; the Triton kernels support"):
        sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, impl="triton")


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels on the same checks, and a larger bf16 problem (K separate PEFT LoRA
# layers: tests/kernels/test_segmented_lora_peft.py)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_kernels(case, dtypes):
    check(make_problem(CASES[case], *DTYPES[dtypes], device="cuda"), "auto")


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", ["bf16", "bf16-fp32-adapters"])
def test_gpu_large(dtypes):
    """Rows of 8 adapters of ranks 8..128 (two 64-wide rank blocks), one segment empty."""
    offs = [0, 700, 700, 2048, 2100, 3000, 3900, 4000, 4096]
    p = make_problem((4096, 2048, 1536, offs, [8, 16, 128, 32, 64, 16, 8, 96]), *DTYPES[dtypes], device="cuda")
    check(p, "auto")


def test_benchmark_dry_path(tmp_path):
    """bench/bench_segmented_lora.py (run on a GPU by `make gpu-check`) imports and runs its CPU path."""
    from bench import bench_segmented_lora

    bench_segmented_lora.main(["--device", "cpu", "--repeats", "1", "--results", str(tmp_path)])
    lines = (tmp_path / "segmented_lora.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * len(bench_segmented_lora.ADAPTERS["cpu"]) * len(bench_segmented_lora.SHAPES["cpu"])


def test_kernels_compile_for_sm90():
    """The kernels compile for sm_90a without a GPU at the launchers' own parameters, fp32 adapters
    on bf16 activations (the library's default, the most registers), ranks of two blocks: no
    spill, shared memory within the 227 KiB of an H100/H200 SM. Every dtype pair:
    `python tests/kernels/_aot_compile_segmented.py` ([Note: segmented LoRA kernel])."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_aot_compile_segmented.py")
    out = subprocess.run([sys.executable, script, "--dtypes", "bf16+fp32", "--ranks", "64", "--json"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 227 * 1024, r
        assert r["BLOCK_R" if "BLOCK_R" in r else ("BLOCK_M" if "dA" in r["kernel"] else "BLOCK_P")] == 16, r


@pytest.mark.gpu
def test_gpu_opcheck():
    """The compiled ops under opcheck (schema, fake impl, AOT dispatch) with CUDA tensors."""

    def cuda(v):
        if isinstance(v, list):
            return [cuda(t) for t in v]
        return v.cuda() if torch.is_tensor(v) else v

    for op, args in _opcheck_samples().values():
        torch.library.opcheck(op, tuple(cuda(a) for a in args))
