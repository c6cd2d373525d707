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

--demo (under torchrun; the demo half):

    torchrun --standalone --nproc-per-node 4 bench/bench_quant.py --demo [--budgets 0,50%]
        [--formats none,int8,nf4,nf4-nested] [--peers fsdp2-nf4[,fsdp2]] [--steps 6] [--passes 2]
        [--results DIR] [finetune options ...]

The fine-tuning CLI's job on the demo model sized for NF4 (NF4_DEMO_OPTIONS in
python_api/finetune/peers/fsdp2_nf4.py: intermediate 768, 8 KV heads; every quantized weight
qualifies for the peer on 4 ranks), trained from scratch in one process group for each weight
format at each pool budget (a share of the frozen bytes *as stored*, so 50% of nf4 is a
seventh of 50% of fp32), beside FSDP2 over torchao NF4 weights (and, with --peers fsdp2, FSDP2 in
full precision): the same base weights, initial adapters, batches and AdamW
(bench/bench_frontier.py's harness: passes in alternating order, tokens/s = global tokens per
step over the median step after the first of each pass, slowest rank). Measured per
configuration: tokens/s and its ratio to FSDP2-NF4's in this run, the bytes all-gathered per
step (counted at the collective, exact) and their ratio to the full-precision run's at the same
budget, the stored bytes of the quantized weights (whole model), the largest loss difference
from the reference of its numerics (none: the first full-precision run, fp32 rounding; nf4 and
nf4-nested: FSDP2-NF4, the NF4 tolerance of [Note: the NF4 peer's loss tolerance] in
python_api/finetune/report.py; int8: its first run). Rows to bench/results/quant_demo.csv.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
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


DEMO_FORMATS = ("none", "int8", "nf4", "nf4-nested")


def demo(argv) -> int:
    """The demo half (see the module docstring): one row per configuration to quant_demo.csv."""
    import tempfile
    import time
    import warnings

    import torch.distributed as dist

    from bench.bench_frontier import Config, _run, _slowest
    from elastic_kernels.api.finetune.engines import ElasticEngine, FSDP2Engine
    from elastic_kernels.api.finetune.formats import check_weight_formats
    from elastic_kernels.api.finetune.job import prepare
    from elastic_kernels.api.finetune.measure import AllGatherCounter
    from elastic_kernels.api.finetune.option_values import _budget, budget_label
    from elastic_kernels.api.finetune.options import parse_args
    from elastic_kernels.api.finetune.peers.fsdp2_nf4 import (
        NF4_DEMO_OPTIONS,
        FSDP2NF4Engine,
        nf4_gathered_bytes,
        padded_numel,
        shape_error,
    )
    from elastic_kernels.api.finetune.report import nf4_gap_bound
    from elastic_kernels.api.nn import adapter_state_dict

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
    ap = argparse.ArgumentParser(description="bench_quant --demo (under torchrun)", allow_abbrev=False)
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--budgets", default="0,50%", help="pool budgets: 0, N%% of the stored frozen bytes, all")
    ap.add_argument("--formats", default=",".join(DEMO_FORMATS), help=f"weight formats, of {', '.join(DEMO_FORMATS)}")
    ap.add_argument("--peers", default="fsdp2-nf4", help="fsdp2-nf4 and/or fsdp2")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per pass (the first is warm-up)")
    ap.add_argument("--passes", type=int, default=2, help="passes over the configurations, alternating order")
    ap.add_argument("--results", default=None, help="folder for quant_demo.csv (default bench/results)")
    opts, rest = ap.parse_known_args(argv)
    formats = [f.strip() for f in opts.formats.split(",") if f.strip()]
    peers = [p.strip() for p in opts.peers.split(",") if p.strip()]
    if [f for f in formats if f not in DEMO_FORMATS] or [p for p in peers if p not in ("fsdp2-nf4", "fsdp2")]:
        ap.error(f"--formats: of {', '.join(DEMO_FORMATS)}; --peers: of fsdp2-nf4, fsdp2")
    if opts.steps < 2 or opts.passes < 1:
        ap.error("--steps must be >= 2 (the first step is warm-up) and --passes >= 1")
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_quant_demo_")
    args = parse_args(list(NF4_DEMO_OPTIONS) + rest + ["--steps", str(opts.steps), "--no-progress", "--overwrite",
                                                       "--save-dir", os.path.join(tmp, f"rank{rank}")])
    job = prepare(args, rank, W, int(os.environ.get("LOCAL_RANK", "0")))
    if args.weight_format != "none":
        raise SystemExit("bench_quant --demo: --formats chooses the weight formats; leave --weight-format out")
    # Checked before anything runs, the same on every rank: the formats' blocks, the peer's shapes.
    # The job's configuration is frozen: the formats compared, as a replaced copy.
    job.cfg = job.cfg.replace("peers", compare_formats=tuple(sorted({f.split("-")[0] for f in formats} - {"none"})))
    job.cfg = job.cfg.replace("weights", quant_nested=False)
    check_weight_formats(job.spec, job.cfg)
    if "fsdp2-nf4" in peers and shape_error(job):
        raise SystemExit(f"bench_quant --demo: {shape_error(job)}")
    device = job.device
    harness.start_group(job, args.timeout_s)
    load = os.getloadavg()
    stored = {}

    def elastic(budget, fmt):
        def build():
            job.cfg = job.cfg.replace("weights", quant_nested=fmt == "nf4-nested")
            engine = ElasticEngine(job, budget, weight_format=fmt.split("-")[0])
            stored[fmt] = engine.frozen_bytes
            return engine
        return build

    def nf4_peer():
        engine = FSDP2NF4Engine(job, counter)
        meta = job.spec.meta_model()
        stored["fsdp2-nf4"] = sum(  # padded where torchao cannot split a weight as it is
            nf4_gathered_bytes(padded_numel(tuple(meta.get_submodule(n).weight.shape), engine.block, job.world_size),
                               engine.block) for n in engine.nf4_weights)
        return engine

    with AllGatherCounter() as counter:
        seed = ElasticEngine(job, None)
        job.initial_adapters = {k: v.clone() for k, v in adapter_state_dict(seed.model).items()}
        del seed
        configs = []
        for fmt in formats:
            for b in (x.strip() for x in opts.budgets.split(",") if x.strip()):
                budget = _budget(b)
                cfg = Config(fmt, f"{fmt}, budget {budget_label(budget)}", elastic(budget, fmt), fmt.split("-")[0])
                cfg.budget = budget_label(budget)
                configs.append(cfg)
        if "fsdp2-nf4" in peers:
            configs.append(Config("fsdp2-nf4", "FSDP2-NF4 (torchao)", nf4_peer, "nf4"))
        if "fsdp2" in peers:
            configs.append(Config("fsdp2", "FSDP2 (full precision)", lambda: FSDP2Engine(job, counter, True), "none"))
        if rank == 0:
            print(f"bench_quant --demo: {len(configs)} configurations x {opts.passes} passes x {opts.steps} steps, "
                  f"{W} ranks ({dist.get_backend()}), {job.spec.description()}; load average {load[0]:.1f}", flush=True)
        t_start = time.perf_counter()
        for p in range(opts.passes):
            for cfg in (configs if p % 2 == 0 else configs[::-1]):
                r = _run(job, cfg, counter, opts.steps, profile_memory=False)
                cfg.passes.append(r)
                if rank == 0:
                    print(f"  pass {p + 1}: {cfg.label:28s} {r['tokens_per_s'] or 0:8.0f} tok/s ({r['wall_s']:.1f} s)",
                          flush=True)
        step_s = {cfg.label: _slowest(statistics.median(t for r in cfg.passes for t in r["step_times_s"][1:]))
                  for cfg in configs}
    load_end = os.getloadavg()
    if rank == 0:
        rows = demo_rows(job, configs, step_s, stored, nf4_gap_bound)
        ctx = harness.context(device)
        out = [{**ctx, "model": job.spec.description(), "world_size": W, "backend": dist.get_backend(),
                "steps": opts.steps, "passes": opts.passes, "load_avg_start": round(load[0], 2),
                "load_avg_end": round(load_end[0], 2), **r} for r in rows]
        harness.print_table(rows, ["config", "tokens_per_s", "vs_fsdp2_nf4", "gathered_bytes_per_step",
                                   "gathered_vs_none", "stored_bytes", "max_abs_loss_diff", "loss_check"])
        print(f"load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end (tokens/s are noise on a loaded "
              f"machine; the bytes are exact); {time.perf_counter() - t_start:.0f} s")
        print(f"rows appended to {harness.append_rows('quant_demo', out, opts.results)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def demo_rows(job, configs, step_s, stored, nf4_gap_bound) -> list[dict]:
    """The demo's rows: ratios within this run; each loss set against its numerics' reference."""
    first = {c.label: c.passes[0] for c in configs}
    refs = {}
    for c in configs:  # FSDP2-NF4 is nf4's reference wherever it ran; else the first of the format
        if c.system == "fsdp2-nf4":
            refs["nf4"] = c
    for c in configs:
        refs.setdefault(c.weight_format, c)
    tps = {c.label: first[c.label]["tokens_per_step"] / step_s[c.label] for c in configs}
    peer = next((c for c in configs if c.system == "fsdp2-nf4"), None)
    none = {getattr(c, "budget", None): c for c in configs if c.system == "none"}
    rows = []
    for c in configs:
        gathered = statistics.median(first[c.label]["allgather_bytes_counted_per_step"][1:])
        ref = refs[c.weight_format]
        ref_losses = ref.passes[0]["losses"]
        diff = max(abs(a - b) for r in c.passes for a, b in zip(r["losses"], ref_losses))
        if c is ref:
            check = "reference"
        elif c.weight_format == "nf4" and ref.system == "fsdp2-nf4":
            check = "within the NF4 tolerance" if diff <= nf4_gap_bound("float32", ref_losses) else "BEYOND the NF4 tolerance"
        else:
            check = "within fp32 rounding" if diff <= 1e-5 else "BEYOND fp32 rounding"
        base = none.get(getattr(c, "budget", None))
        base_bytes = None if base is None else statistics.median(first[base.label]["allgather_bytes_counted_per_step"][1:])
        rows.append({
            "config": c.label, "weight_format": c.system, "budget": getattr(c, "budget", ""),
            "tokens_per_s": round(tps[c.label], 1),
            "vs_fsdp2_nf4": None if peer is None else round(tps[c.label] / tps[peer.label], 3),
            "gathered_bytes_per_step": int(gathered),
            "gathered_bytes_first_step": int(first[c.label]["allgather_bytes_counted_per_step"][0]),
            "gathered_vs_none": None if not base_bytes else round(gathered / base_bytes, 4),
            "stored_bytes": stored.get(c.system),
            "max_abs_loss_diff": diff, "loss_reference": ref.label, "loss_check": check,
        })
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--demo" in argv:
        return demo(argv)
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
    code = main()
    if "--demo" in sys.argv[1:]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # [Note: exiting without teardown] in python_api/finetune/cli.py
