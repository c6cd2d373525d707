"""Paged LoRA linear kernels against dense GEMMs, measured in the same run.

CUDA (bf16): the Triton ops `elastic::paged_lora_linear_fwd` (plain, and with LoRA + bias fused),
`elastic::paged_lora_linear_dgrad` (with LoRA) and `elastic::lora_adapter_grads`, W read through
a page table of pool pages of about --chunk-mib MiB of whole rows (pages in shuffled order),
against cuBLAS on a contiguous W of the same shape (`x @ W.T`, `dy @ W`) and against eager
PyTorch for the LoRA parts. Candidate and baseline are timed alternately, --inner calls each
per repeat (median of --repeats after --warmup), so that a busy machine affects both alike.
Figures: ms, TFLOP/s, GB/s of compulsory traffic, and
vs_baseline = baseline time / candidate time (issue 5 target: plain paged forward >= 0.9 of
dense cuBLAS).

CPU (fp32): the pure-torch reference (the CPU default) against dense `F.linear` / eager LoRA:
vs_baseline < 1 is the reference's overhead.

    python bench/bench_paged_linear.py --device cuda [--results DIR]
    python bench/bench_paged_linear.py --device cpu  [--results DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from elastic_kernels.ops import paged_linear as pl  # noqa: E402

CUDA_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]  # (in_features K, out_features N)
CUDA_TOKENS = [2048, 4096, 8192, 16384]
CPU_SHAPES = [(1024, 1024), (1024, 2816), (2816, 1024)]
CPU_TOKENS = [256]


def paged_weight(weight: torch.Tensor, chunk_bytes: int, seed: int = 0) -> tuple[list[torch.Tensor], int]:
    """Chunks of whole rows (about chunk_bytes each) as views of one pool, pages shuffled."""
    n, k = weight.shape
    rows = max(1, min(n, chunk_bytes // (k * weight.element_size())))
    num = -(-n // rows)
    pool = torch.empty((num + 1, rows * k), dtype=weight.dtype, device=weight.device)
    order = torch.randperm(num + 1, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks = []
    for c in range(num):
        piece = weight[c * rows : (c + 1) * rows]
        view = pool[order[c], : piece.numel()].view(piece.shape[0], k)
        view.copy_(piece)
        chunks.append(view)
    return chunks, rows


def paired(fn, base_fn, device: str, warmup: int, repeats: int, inner: int) -> tuple[float, float]:
    """Median seconds per call of fn and of base_fn, timed alternately (`inner` back-to-back
    calls of each per repeat, `repeats` times) after warm-up, so that load from other processes
    hits both alike. On CUDA, inner > 1 lets the host run ahead of the GPU as in training, so
    the figure is the kernels' time, not the launch latency plus a device synchronisation."""

    def batch(f):
        return lambda: [f() for _ in range(inner)]

    fa, fb = batch(fn), batch(base_fn)
    harness.measure(fa, device, warmup=warmup, repeats=1)
    harness.measure(fb, device, warmup=warmup, repeats=1)
    a, b = [], []
    for _ in range(repeats):
        a.append(harness.measure(fa, device, warmup=0, repeats=1) / inner)
        b.append(harness.measure(fb, device, warmup=0, repeats=1) / inner)
    return statistics.median(a), statistics.median(b)


def bench_shape(device: str, dtype: torch.dtype, t: int, k: int, n: int, r: int, chunk_bytes: int,
                impl: str, warmup: int, repeats: int, inner: int) -> list[dict]:  # fmt: skip
    gen = torch.Generator(device).manual_seed(0)  # drawn on the device: 16k x 11008 on the host is slow

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x, dy = rnd(t, k), rnd(t, n)
    weight, bias = rnd(n, k, scale=k**-0.5), rnd(n)
    lora_a, lora_b = rnd(r, k, scale=k**-0.5), rnd(n, r, scale=r**-0.5)
    xa, dyb = rnd(t, r), rnd(t, r)
    s = 2.0
    chunks, rpc = paged_weight(weight, chunk_bytes)
    es = x.element_size()

    # A kernel that computes the wrong thing is not benchmarked.
    y_paged, _ = pl.paged_lora_linear_fwd(x, chunks, impl=impl)
    y_dense = F.linear(x, weight)
    rel = ((y_paged.float() - y_dense.float()).norm() / y_dense.float().norm()).item()
    if rel > 1e-2:
        raise AssertionError(f"paged forward differs from dense by {rel:.3g} (relative) at T={t} K={k} N={n}")

    def eager_lora_fwd():
        return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_a), lora_b) * s

    def eager_dgrad():
        return dy @ weight + ((dy @ lora_b) @ lora_a) * s

    def eager_grads():
        return (dyb.t() @ x) * s, (dy.t() @ xa) * s

    # (op, candidate, flops, bytes, baseline name, baseline fn, baseline flops)
    gemm = 2.0 * t * n * k
    lora_fwd = 2.0 * t * r * (k + n)
    cases = [
        ("fwd_plain", lambda: pl.paged_lora_linear_fwd(x, chunks, impl=impl), gemm,
         es * (t * k + n * k + t * n), "dense_mm" if device == "cuda" else "F.linear",
         lambda: x @ weight.t() if device == "cuda" else F.linear(x, weight), gemm),
        ("fwd_lora_bias", lambda: pl.paged_lora_linear_fwd(x, chunks, bias, x, lora_a, lora_b, s, impl=impl),
         gemm + lora_fwd, es * (t * k + n * k + t * n + t * r), "dense_mm" if device == "cuda" else "F.linear",
         lambda: x @ weight.t() if device == "cuda" else F.linear(x, weight), gemm),
        ("fwd_lora_bias", lambda: pl.paged_lora_linear_fwd(x, chunks, bias, x, lora_a, lora_b, s, impl=impl),
         gemm + lora_fwd, es * (t * k + n * k + t * n + t * r), "eager_lora", eager_lora_fwd, gemm + lora_fwd),
        ("dgrad_lora", lambda: pl.paged_lora_linear_dgrad(dy, chunks, lora_a, lora_b, s, impl=impl),
         gemm + lora_fwd, es * (t * n + n * k + t * k + t * r), "dense_mm", lambda: dy @ weight, gemm),
        ("dgrad_lora", lambda: pl.paged_lora_linear_dgrad(dy, chunks, lora_a, lora_b, s, impl=impl),
         gemm + lora_fwd, es * (t * n + n * k + t * k + t * r), "eager_lora", eager_dgrad, gemm + lora_fwd),
        ("adapter_grads", lambda: pl.lora_adapter_grads(x, xa, dy, dyb, s, impl=impl), lora_fwd,
         es * (t * k + t * n + 2 * t * r + r * (k + n)), "eager", eager_grads, lora_fwd),
    ]  # fmt: skip
    rows = []
    for op, fn, flops, nbytes, base_name, base_fn, base_flops in cases:
        sec, base_sec = paired(fn, base_fn, device, warmup, repeats, inner)
        rows.append({
            **harness.context(device),
            "op": op, "impl": impl, "dtype": str(dtype).replace("torch.", ""),
            "T": t, "K": k, "N": n, "r": r, "rows_per_chunk": rpc, "chunks": len(chunks),
            "ms": sec * 1e3, "tflops": flops / sec / 1e12, "gbps": nbytes / sec / 1e9,
            "baseline": base_name, "baseline_ms": base_sec * 1e3, "baseline_tflops": base_flops / base_sec / 1e12,
            "vs_baseline": base_sec / sec, "calls_per_timing": inner, "threads": torch.get_num_threads(),
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="paged LoRA linear kernels vs dense GEMMs")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--results", default=None, help="folder for paged_linear.csv (default bench/results)")
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts (default per device)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated KxN (in x out) list, e.g. 4096x4096,4096x11008 (default per device)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--chunk-mib", type=float, default=None, help="page size in MiB of whole rows (cuda 2, cpu 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's own); 1 avoids OpenMP barrier stalls "
                         "on a shared machine")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--inner", type=int, default=None, help="back-to-back calls per timing (cuda 10, cpu 1)")
    args = ap.parse_args(argv)

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no usable CUDA device")
        dtype, impl = torch.bfloat16, "triton"
        shapes, tokens, chunk_mib = CUDA_SHAPES, CUDA_TOKENS, 2.0
    else:
        dtype, impl = torch.float32, "reference"
        shapes, tokens, chunk_mib = CPU_SHAPES, CPU_TOKENS, 1.0
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = args.tokens or tokens
    inner = args.inner or (10 if args.device == "cuda" else 1)
    chunk_bytes = int((args.chunk_mib or chunk_mib) * 2**20)

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {harness.device_name(args.device)} ({torch.get_num_threads()} torch threads), torch {torch.__version__}, "
          f"{dtype}, impl={impl}, r={args.rank}, "
          f"pages of ~{chunk_bytes / 2**20:g} MiB; median of {args.repeats} x {inner} calls "
          f"after {args.warmup} warm-up")  # fmt: skip
    rows = []
    for k, n in shapes:
        for t in tokens:
            rows += bench_shape(args.device, dtype, t, k, n, args.rank, chunk_bytes, impl, args.warmup, args.repeats,
                                inner)
            harness.print_table(rows[-6:], ["op", "T", "K", "N", "rows_per_chunk", "ms", "tflops", "gbps",
                                            "baseline", "baseline_ms", "baseline_tflops", "vs_baseline"])  # fmt: skip
    path = harness.append_rows("paged_linear", rows, args.results)
    print(f"# {len(rows)} rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
