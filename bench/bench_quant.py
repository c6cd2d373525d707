"""Dequant throughput of the quantized chunk formats: GB/s of output written, each impl against
the pure-torch reference and against a plain copy of the same output, in the same run.

    python bench/bench_quant.py [--device cpu|cuda] [--threads N] [--results DIR] [--error-sweep]

Weights of Llama-7B shapes (q/k/v/o 4096 x 4096, gate/up 11008 x 4096, down 4096 x 11008; CPU:
the first only unless --shapes), chunks of --chunk-mib MiB of bf16 output (4: 512 rows of 4096),
formats nf4, nf4 with nested scales, int8 (block 256), output --dtype (bf16). One call
dequantizes every chunk of the weight (a list of separate blob tensors, as pool pages are).
``gbps`` = output bytes / time; ``copy`` is ``dst.copy_(src)`` of a tensor of the output's size
and dtype, the device's copy rate in this run (it reads as many bytes as it writes, dequant
reads 1/4 (nf4, bf16 out) or 1/2 (int8) of them, so >100% is possible); ``pct_of_copy`` is
gbps / copy's gbps, ``vs_reference`` gbps / the reference's. Impls: cpp (CPU, the C++ op),
triton (CUDA; under the CPU interpreter its timing means nothing), reference. Every impl's
output is compared bitwise with the reference's before it is timed. Rows go to
bench/results/quant.csv.

--error-sweep: for int8 blocks of 32-4096 ([Note: int8 block size] in elastic_kernels/quant/
int8.py), the round-trip relative RMS error on a Llama-like 1024 x 4096 weight, the bits per
weight and the dequant GB/s of the fast impl; rows to bench/results/quant_int8_blocks.csv.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from elastic_kernels import _ext, dequantize  # noqa: E402
from elastic_kernels.quant import QuantizedLayout  # noqa: E402

MIB = 2**20
SHAPES = {"qkvo": (4096, 4096), "gate_up": (11008, 4096), "down": (4096, 11008)}
FORMATS = {"nf4": ("nf4", None, False), "nf4_nested": ("nf4", None, True), "int8": ("int8", 256, False)}


@functools.lru_cache(maxsize=1)  # one weight per shape, quantized to every format
def llama_like(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed, column-scaled weights (Student-t(5) * 0.02, columns scaled by exp(N(0, 0.3)))."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.zeros(rows, cols)
    for _ in range(5):
        chi2 += torch.randn(rows, cols, generator=g).pow(2)
    t = z / torch.sqrt(chi2 / 5)
    return t * 0.02 * torch.exp(torch.randn(cols, generator=g) * 0.3)


def impls(device: str) -> list[str]:
    if device == "cuda":
        return ["triton", "reference"]
    return (["cpp"] if _ext.available() else []) + ["reference"]


def bench_weight(device, shape, fmt_name, dtype, chunk_mib, repeats, impl_names):
    rows, cols = shape
    fmt, block, nested = FORMATS[fmt_name]
    es = torch.empty((), dtype=dtype).element_size()
    rows_per_chunk = max(1, chunk_mib * MIB // (cols * es))
    lay = QuantizedLayout(rows, cols, rows_per_chunk, fmt, block_size=block, nested=nested)
    w = llama_like(rows, cols)
    blobs = [b.clone().to(device) for b in lay.blobs(lay.quantize(w))]
    out_bytes = rows * cols * es

    def measure(fn):
        return harness.measure(fn, device, warmup=2, repeats=repeats)

    src = torch.ones(rows, cols, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    results = [("copy", measure(lambda: dst.copy_(src)))]
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    want = dequantize(blobs, lay.formats[0], rows, dtype=dtype, impl="reference")
    for name in impl_names:
        got = dequantize(blobs, lay.formats[0], rows, dtype=dtype, out=out, impl=name)
        assert torch.equal(got.view(torch.int16 if es == 2 else torch.int32),
                           want.view(torch.int16 if es == 2 else torch.int32)), f"{name} differs from the reference"  # fmt: skip
        results.append((name, measure(lambda name=name: dequantize(blobs, lay.formats[0], rows, dtype=dtype, out=out,
                                                                     impl=name))))  # fmt: skip
    return lay, out_bytes, results


def error_sweep(device, dtype, repeats, ctx, results_dir):
    rows, cols = 1024, 4096
    w = llama_like(rows, cols, seed=1)
    fast = impls(device)[0]
    rows_out = []
    for block in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        lay = QuantizedLayout(rows, cols, rows, "int8", block_size=block)
        blobs = [b.to(device) for b in lay.blobs(lay.quantize(w))]
        got = dequantize(blobs, lay.formats[0], rows, dtype=torch.float32, impl=fast).cpu()
        rel = float((got - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())
        out = torch.empty(rows, cols, dtype=dtype, device=device)
        t = harness.measure(lambda: dequantize(blobs, lay.formats[0], rows, out=out, impl=fast), device,
                            warmup=2, repeats=repeats)  # fmt: skip
        rows_out.append({
            **ctx,
            "threads": torch.get_num_threads() if device == "cpu" else 0,
            "impl": fast,
            "dtype": str(dtype).replace("torch.", ""),
            "rows": rows,
            "cols": cols,
            "block": block,
            "bits_per_weight": round(lay.total_bytes * 8 / (rows * cols), 4),
            "rel_rms_error": round(rel, 6),
            "time_us": round(t * 1e6, 1),
            "gbps": round(rows * cols * out.element_size() / t / 1e9, 3),
        })  # fmt: skip
    harness.print_table(rows_out, ["block", "bits_per_weight", "rel_rms_error", "time_us", "gbps"])
    print(f"rows appended to {harness.append_rows('quant_int8_blocks', rows_out, results_dir)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--results", default=None, help="folder for quant.csv (default bench/results or $ELASTIC_BENCH_RESULTS)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=None, help="default: all on CUDA, qkvo on CPU")
    ap.add_argument("--formats", nargs="*", choices=list(FORMATS), default=list(FORMATS))
    ap.add_argument("--chunk-mib", type=int, default=4, help="MiB of output per chunk (one blob each)")
    ap.add_argument("--repeats", type=int, default=None, help="default 11 on CUDA, 5 on CPU")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU; default: torch's)")
    ap.add_argument("--error-sweep", action="store_true", help="int8 block-size sweep (error, bits, GB/s) only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    dtype = getattr(torch, args.dtype)
    repeats = args.repeats or (11 if device == "cuda" else 5)
    ctx = harness.context(device)
    names = impls(device)
    print(f"bench_quant: {ctx['device']}, torch {ctx['torch']}, threads {torch.get_num_threads()}, impls {names}, "
          f"out {args.dtype}")  # fmt: skip
    if args.error_sweep:
        error_sweep(device, dtype, repeats, ctx, args.results)
        return
    shapes = args.shapes or (list(SHAPES) if device == "cuda" else ["qkvo"])
    rows = []
    for shape_name in shapes:
        for fmt_name in args.formats:
            lay, out_bytes, results = bench_weight(device, SHAPES[shape_name], fmt_name, dtype, args.chunk_mib,
                                                   repeats, names)  # fmt: skip
            gbps = {name: out_bytes / t / 1e9 for name, t in results}
            for name, t in results:
                rows.append({
                    **ctx,
                    "threads": torch.get_num_threads() if device == "cpu" else 0,
                    "format": fmt_name if name != "copy" else "-",
                    "impl": name,
                    "dtype": args.dtype,
                    "shape": f"{lay.rows}x{lay.cols}",
                    "chunks": lay.num_chunks,
                    "blob_bytes": lay.total_bytes if name != "copy" else 0,
                    "out_bytes": out_bytes,
                    "time_us": round(t * 1e6, 1),
                    "gbps": round(gbps[name], 3),
                    "pct_of_copy": round(100 * gbps[name] / gbps["copy"], 1),
                    "vs_reference": round(gbps[name] / gbps["reference"], 2),
                })  # fmt: skip
    harness.print_table(rows, ["format", "impl", "shape", "chunks", "time_us", "gbps", "pct_of_copy", "vs_reference"])
    print(f"rows appended to {harness.append_rows('quant', rows, args.results)}")


if __name__ == "__main__":
    main()
