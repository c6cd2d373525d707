"""SIMULATION (not a measurement): the planner's cost and memory models applied to the mTuner
paper's settings.

Llama-2 7B / 13B / 70B shapes at sequence lengths 2k and 4k on
  - 8 x A100-40G PCIe, one node (all-gather bus bandwidth ~25 GB/s), and
  - 4 x 8 H100 SXM (NVLink ~350 GB/s within a node; between nodes, an assumption: one 400 Gb/s
    NDR InfiniBand NIC per GPU, ~40 GB/s achieved, so a 32-rank all-gather moves 24/31 of its
    bytes over InfiniBand at ~40 GB/s per GPU: ~52 GB/s of received bytes per rank),
with the FLOP rates, memory and link figures of `python_api/planner/shapes.py` (DEVICES; 50% of
the dense bf16 peak) and its synthetic profiles (LoRA rank 16 on the 7 projections, bf16
frozen weights, 4 MiB chunks). Global batch: 8 sequences per rank per optimizer step. Every
configuration gets the whole device memory (margin 5%).

Predicted tokens/s (global batch x seq_len / predicted step time) for:
  fsdp       FSDP / ZeRO-3: every chunk gathered at every use (k = p = 0 everywhere); the
             micro-batch and the recomputed layers chosen by the same search so it fits.
  threshold  a static persistence threshold, DeepSpeed-like: every weight with fewer elements
             than the threshold is kept whole and persistent (the semantics of DeepSpeed's
             `stage3_param_persistence_threshold`, default 1e5 elements); the best of the
             thresholds 1e5 (DeepSpeed's default), 1e6, 1e7, 2e7, 5e7, 1e8, 2e8 that fits;
             micro-batch and recompute searched as for fsdp.
  planner    plan_from_profile without the host tier.
  planner+host  the full planner (host tier): the same profile with the host tier
             (python_api/planner/shapes.py: each GPU's own PCIe link to the host, ASSUMED
             ~25 GB/s achieved on A100 PCIe Gen4 x16 and ~50 GB/s on H100 SXM Gen5 x16, 10 us
             per copy batch, no sharing of PCIe switches or host memory bandwidth modelled;
             a host store of the frozen weights; no host budget), the planner choosing the host
             fraction in {0, 1/4, 1/2, 3/4, 1} and activation offload on/off besides the rest.
             The shards stay on the device (weights_on="device"); the offloaded activations'
             copies are assumed to overlap the adjacent layer's compute as the cost model says.

Writes bench/results/simulate_mtuner.csv (rewritten each run: a simulation is a function of the
code, not of the machine). Every figure here is a model prediction, labelled SIMULATION.

    .venv/bin/python bench/simulate_mtuner.py
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic_kernels.api.planner.search import PlanningError, plan_from_profile, plan_with_residency  # noqa: E402
from elastic_kernels.api.planner.shapes import DEVICES, shape_of, synthetic_profile  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "simulate_mtuner.csv")
SETTINGS = [("a100-40g-pcie", 8), ("h100-sxm", 32)]
SHAPES = ["llama2-7b", "llama2-13b", "llama2-70b"]
SEQ_LENS = [2048, 4096]
PER_RANK_BATCH = 8
MARGIN = 0.05
THRESHOLDS = [1e5, 1e6, 1e7, 2e7, 5e7, 1e8, 2e8]


def weight_numels(shape: str) -> dict[str, int]:
    m = shape_of(shape)
    out = {name: rows * cols for name, rows, cols in m.projections()}
    out["lm_head"] = m.vocab * m.hidden
    return out


def threshold_keep(profile, shape: str, threshold: float) -> list[list[int]]:
    numel = weight_numels(shape)
    return [[w.chunks if numel[w.name] < threshold else 0 for w in layer.weights] for layer in profile.layers]


def row(device, ranks, shape, seq, G, method, plan, note=""):
    base = {"kind": "SIMULATION", "date": datetime.date.today().isoformat(), "commit": _commit(),
            "device": device, "ranks": ranks, "shape": shape, "seq_len": seq, "global_batch": G, "method": method}
    if plan is None:
        return {**base, "micro_batch": "", "accumulation": "", "recomputed_layers": "", "kept_pct": "",
                "peak_gib": "", "allgather_gib_per_step": "", "step_s": "", "tokens_per_s": "", "note": note}
    return {**base, "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
            "recomputed_layers": sum(lp.recompute for lp in plan.layers),
            "kept_pct": round(100.0 * plan.kept_chunks / plan.total_chunks, 2),
            "peak_gib": round(plan.predicted_peak_bytes / 2**30, 3),
            "allgather_gib_per_step": round(plan.predicted_allgather_bytes_per_step / 2**30, 2),
            "step_s": round(plan.predicted_step_time_s, 4),
            "tokens_per_s": round(G * seq / plan.predicted_step_time_s, 1),
            "note": note}


_COMMIT = None


def _commit() -> str:
    global _COMMIT
    if _COMMIT is None:
        try:
            _COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            _COMMIT = ""
        _COMMIT = _COMMIT or "unknown"
    return _COMMIT


def simulate() -> list[dict]:
    rows = []
    for device, ranks in SETTINGS:
        memory = DEVICES[device].capacity_bytes
        for shape in SHAPES:
            for seq in SEQ_LENS:
                G = PER_RANK_BATCH * ranks
                profile = synthetic_profile(shape, ranks, seq, device)
                zeros = [[0] * len(layer.weights) for layer in profile.layers]
                try:
                    fsdp = plan_with_residency(profile, memory, G, zeros, margin=MARGIN)
                    rows.append(row(device, ranks, shape, seq, G, "fsdp", fsdp))
                except PlanningError as exc:
                    rows.append(row(device, ranks, shape, seq, G, "fsdp", None, f"does not fit: {exc}"))
                best = None
                for threshold in THRESHOLDS:
                    try:
                        p = plan_with_residency(profile, memory, G, threshold_keep(profile, shape, threshold),
                                                margin=MARGIN)
                    except PlanningError:
                        continue
                    if best is None or p.predicted_step_time_s < best[1].predicted_step_time_s:
                        best = (threshold, p)
                if best is None:
                    rows.append(row(device, ranks, shape, seq, G, "threshold", None, "no threshold fits"))
                else:
                    rows.append(row(device, ranks, shape, seq, G, "threshold", best[1],
                                    f"persistence threshold {best[0]:.0e} elements"))
                try:
                    plan = plan_from_profile(profile, memory, G, margin=MARGIN)
                    rows.append(row(device, ranks, shape, seq, G, "planner", plan,
                                    f"planned in {plan.planning_seconds:.3f} s"))
                except PlanningError as exc:
                    rows.append(row(device, ranks, shape, seq, G, "planner", None, f"does not fit: {exc}"))
                host_profile = synthetic_profile(shape, ranks, seq, device, host_tier=True)
                try:
                    plan = plan_from_profile(host_profile, memory, G, margin=MARGIN)
                    rows.append(row(device, ranks, shape, seq, G, "planner+host", plan,
                                    f"host fraction {plan.host_fraction:g}, offload "
                                    f"{'on' if plan.offload_activations else 'off'}, H2D "
                                    f"{plan.predicted_h2d_bytes_per_step / 2**30:.1f} GiB/step; planned in "
                                    f"{plan.planning_seconds:.3f} s"))
                except PlanningError as exc:
                    rows.append(row(device, ranks, shape, seq, G, "planner+host", None, f"does not fit: {exc}"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=RESULTS, help="CSV to write (default: bench/results/simulate_mtuner.csv)")
    args = parser.parse_args(argv)
    rows = simulate()
    print("SIMULATION: predicted by the planner's cost and memory models, not measured")
    for device, ranks in SETTINGS:
        spec = DEVICES[device]
        link = spec.allgather(ranks)
        print(f"  {device} x{ranks}: {spec.flops / 1e12:.0f} TFLOP/s achieved bf16 (50% of peak), "
              f"{spec.capacity_bytes / 2**30:.0f} GiB, all-gather {link.bytes_per_s / 1e9:.1f} GB/s received per rank "
              f"+ {link.latency_s * 1e6:.0f} us; host link (ASSUMED, PCIe) {spec.h2d_bytes_per_s / 1e9:.0f} GB/s "
              f"+ {spec.h2d_latency_s * 1e6:.0f} us")
    cols = ["device", "ranks", "shape", "seq_len", "method", "micro_batch", "accumulation", "recomputed_layers",
            "kept_pct", "peak_gib", "step_s", "tokens_per_s", "vs_fsdp", "note"]
    fsdp_tps = {}
    for r in rows:
        if r["method"] == "fsdp" and r["tokens_per_s"] != "":
            fsdp_tps[r["device"], r["shape"], r["seq_len"]] = r["tokens_per_s"]
    table = []
    for r in rows:
        ref = fsdp_tps.get((r["device"], r["shape"], r["seq_len"]))
        vs = f"{r['tokens_per_s'] / ref:.2f}x" if ref and r["tokens_per_s"] != "" else ""
        table.append({**r, "vs_fsdp": vs, "note": r["note"][:80]})
    widths = {c: max(len(c), *(len(str(t[c])) for t in table)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for t in table:
        print("  ".join(str(t[c]).ljust(widths[c]) for c in cols))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    print(f"SIMULATION rows written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
