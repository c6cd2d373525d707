"""Planning time of the planner for the Llama-2 7B / 13B / 70B shapes on 8 ranks.

Synthetic profiles (python_api/planner/shapes.py; 8 x A100-40G PCIe, seq 4096), 40 GB per
rank, global batch 64: the median of 5 timed calls of `plan_from_profile` after one warm-up,
in seconds, wall clock on this machine (pure Python, one thread). The requirement is under 1 s
for the 80-layer 70B shape. Rows are appended to bench/results/planner.csv with the date and
the machine. The same with the host tier in the profile (a host store, weights_on "device":
ten (host fraction, activation offload) candidates; and weights_on "host": two), rows in
bench/results/planner_host.csv.

    .venv/bin/python bench/bench_planner.py [--repeats 5] [--results DIR] [--no-demo]

Then the search at full width on profiles whose layers differ, as measured ones do: 70B (80
layers) on 8 ranks with the host tier and every dimension searched (prefetch depth 1 and 2,
five host fractions, offload on/off, every micro-batch and recompute count), the timings of
each decoder layer jittered by +-1% (`synthetic_profile(jitter=0.01)`), on the H100-80G shape
at 80 GB and the A100-40G shape at 40 GB, with the same profiles unjittered as the baseline
of the same run; rows in bench/results/planner_jitter.csv (target: under 1 s).

Then, unless --no-demo, the planner against hand-picked settings on this machine: the demo
model on `--world-size` (4) gloo ranks under 3 memory caps (bench/planner_grid.py), rows in
bench/results/planner_demo.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import append_rows, context, print_table  # noqa: E402
from elastic_kernels.api.planner.search import plan_from_profile  # noqa: E402
from elastic_kernels.api.planner.shapes import synthetic_profile  # noqa: E402

SHAPES = ["llama2-7b", "llama2-13b", "llama2-70b"]
RANKS = 8
SEQ_LEN = 4096
MEMORY = 40 * 10**9
GLOBAL_BATCH = 64
DEVICE_SPEC = "a100-40g-pcie"
TARGET_S = 1.0


def planning_times(shape: str, repeats: int, weights_on: str | None = None) -> tuple[list[float], object]:
    """`weights_on` None: no host tier; "device" / "host": the host tier's dimensions searched."""
    profile = synthetic_profile(shape, RANKS, SEQ_LEN, DEVICE_SPEC, host_tier=weights_on is not None,
                                weights_on=weights_on or "device")
    plan = plan_from_profile(profile, MEMORY, GLOBAL_BATCH)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_from_profile(profile, MEMORY, GLOBAL_BATCH)
        times.append(time.perf_counter() - t0)
    return times, plan


JITTER_CASES = [("h100-sxm", 80 * 10**9), ("a100-40g-pcie", 40 * 10**9)]


def jittered_rows(repeats: int, ctx: dict) -> list[dict]:
    """Planning time with every dimension searched, on jittered and plain 70B profiles."""
    from elastic_kernels.api.planner.search import _search

    rows = []
    for device, memory in JITTER_CASES:
        for jitter in (0.0, 0.01):
            profile = synthetic_profile("llama2-70b", RANKS, SEQ_LEN, device, host_tier=True, jitter=jitter, seed=1)
            memory = min(memory, profile.capacity_bytes)
            stats: dict = {}
            plan = _search(profile, memory, GLOBAL_BATCH, None, 0.05, None, "chunks", stats=stats)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = plan_from_profile(profile, memory, GLOBAL_BATCH, prefetch_depth=None)
                times.append(time.perf_counter() - t0)
            rows.append({
                **ctx, "machine": ctx["device"], "shape": "llama2-70b", "ranks": RANKS, "seq_len": SEQ_LEN,
                "device_spec": device, "host_tier": True, "jitter": jitter, "memory_bytes": memory,
                "global_batch": GLOBAL_BATCH, "dimensions": "depth{1,2} x f{0,.25,.5,.75,1} x offload{off,on} x mb x R",
                "layers": len(plan.layers), "chunks": plan.total_chunks, "repeats": repeats,
                "candidates_visited": stats["visited"], "exact_evaluations": stats["evaluated"],
                "pruned_by_bound": stats["bounded"], "prefetch_depth": plan.prefetch_depth,
                "host_fraction": plan.host_fraction, "offload_activations": plan.offload_activations,
                "micro_batch": plan.micro_batch, "recomputed_layers": sum(lp.recompute for lp in plan.layers),
                "predicted_step_time_s": round(plan.predicted_step_time_s, 4),
                "planning_s_median": round(statistics.median(times), 4), "planning_s_min": round(min(times), 4),
                "load_average_1min": round(os.getloadavg()[0], 2), "target_s": TARGET_S,
            })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default=None, help="folder for planner.csv (default bench/results)")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo-model grid (planning times only)")
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks of the demo-model grid")
    parser.add_argument("--steps", type=int, default=6, help="steps per run of the demo-model grid")
    args = parser.parse_args(argv)
    ctx = context("cpu")
    rows = []
    for shape in SHAPES:
        times, plan = planning_times(shape, args.repeats)
        rows.append({
            **ctx, "machine": ctx["device"], "shape": shape, "ranks": RANKS, "seq_len": SEQ_LEN,
            "device_spec": DEVICE_SPEC, "memory_bytes": MEMORY, "global_batch": GLOBAL_BATCH,
            "layers": len(plan.layers), "chunks": plan.total_chunks, "repeats": args.repeats,
            "planning_s_median": round(statistics.median(times), 5), "planning_s_min": round(min(times), 5),
            "target_s": TARGET_S,
        })
    print_table(rows, ["shape", "layers", "chunks", "repeats", "planning_s_median", "planning_s_min", "target_s"])
    print(f"machine: {ctx['device']}")
    path = append_rows("planner", rows, args.results)
    print(f"appended {len(rows)} rows to {path}")
    host_rows = []
    for shape in SHAPES:
        for weights_on in ("device", "host"):
            times, plan = planning_times(shape, args.repeats, weights_on)
            host_rows.append({
                **ctx, "machine": ctx["device"], "shape": shape, "ranks": RANKS, "seq_len": SEQ_LEN,
                "device_spec": DEVICE_SPEC, "weights_on": weights_on, "memory_bytes": MEMORY,
                "global_batch": GLOBAL_BATCH, "layers": len(plan.layers), "chunks": plan.total_chunks,
                "repeats": args.repeats, "host_fraction": plan.host_fraction,
                "offload_activations": plan.offload_activations,
                "planning_s_median": round(statistics.median(times), 5), "planning_s_min": round(min(times), 5),
                "target_s": TARGET_S,
            })
    print_table(host_rows, ["shape", "weights_on", "host_fraction", "offload_activations", "repeats",
                            "planning_s_median", "planning_s_min", "target_s"])
    path = append_rows("planner_host", host_rows, args.results)
    print(f"appended {len(host_rows)} rows to {path}")
    jit_rows = jittered_rows(args.repeats, ctx)
    print_table(jit_rows, ["device_spec", "jitter", "memory_bytes", "candidates_visited", "exact_evaluations",
                           "pruned_by_bound", "prefetch_depth", "host_fraction", "offload_activations",
                           "recomputed_layers", "planning_s_median", "planning_s_min", "load_average_1min", "target_s"])
    path = append_rows("planner_jitter", jit_rows, args.results)
    print(f"appended {len(jit_rows)} rows to {path}")
    if not args.no_demo:
        demo_grid(args, ctx)
    return 0


def demo_grid(args, ctx) -> None:
    """The planner against the best and worst hand-picked settings (bench/planner_grid.py)."""
    from bench.planner_grid import grid_worker
    from tests._dist import run_distributed

    rows = run_distributed(grid_worker, args.world_size, args.steps, timeout=3600)[0]
    rows = [{**ctx, "world_size": args.world_size, "steps": args.steps, **r} for r in rows]
    by_cap: dict[int, dict] = {}
    for r in rows:
        by_cap.setdefault(r["memory_cap_bytes"], {})[r["run"]] = r
    for r in rows:
        best = by_cap[r["memory_cap_bytes"]].get("best hand-picked")
        r["tokens_per_s_vs_best"] = round(r["tokens_per_s"] / best["tokens_per_s"], 3) if best else None
    print_table(rows, ["memory_cap_bytes", "run", "setting", "fitting_settings", "tokens_per_s", "tokens_per_s_vs_best",
                       "allgather_bytes_per_step", "predicted_peak_bytes", "measured_peak_bytes_rank0"])
    path = append_rows("planner_demo", rows, args.results)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    sys.exit(main())
