"""The fine-tuning CLI's report: one table (stdout, markdown, CSV) and one picture (PNG).

Each run is a dict with at least: name, tokens_per_s, peak_memory_bytes, allgather_bytes_steady,
allgather_bytes_first_step, final_loss, heldout_loss, losses (one per optimizer step, index =
step). The baseline (if any) is the first run whose kind is "fsdp2"; ratios are against it.
Beside the table, each elastic run is set against the fastest peer run that needed no more
memory ([Note: the frontier's question] in python_api/finetune/peers/frontier.py).
"""

from __future__ import annotations

import csv
import io
import math
import statistics

from .peers.frontier import ELASTIC_KINDS, best_peer_at_or_below, plot_frontier, system_of

MiB = 2**20

COLUMNS = [
    "run",
    "tokens/s",
    "tokens/s vs FSDP2",
    "peak memory MiB",
    "tensor peak MiB",
    "all-gather MiB/step (steady)",
    "all-gather MiB (first step)",
    "host->device MiB/step (steady)",
    "all-gathers/step (steady)",
    "final train loss",
    "held-out loss",
]


# [Note: the loss gap to the baseline]
# The elastic runs and the FSDP2 baseline compute the same losses in exact arithmetic and
# differ only by rounding ([Note: what is compared with FSDP2, and the tolerance] in
# engines.py). A gap larger than that means they do not compute the same thing (the bad-input
# sweep found a tied head over untied files giving 0.197, reported as a plain number), so a
# gap beyond the bound below is a warning on stdout, in results.md and in summary.json:
#     bound = (FP32_ULPS x eps(float32) + eps(dtype)) x the largest baseline loss compared.
# The first term is fp32 summation order (the loss, the adapters and their optimizer are fp32
# in every dtype): with 20 it is about the suite's 1e-5 at a loss of 5.5, 60x the largest fp32
# gap measured (2.4e-7 over 40 steps). The second is one unit of the model dtype's precision
# (the base weights and activations round at different points in the two runs): measured on
# tests/finetune's tiny config, 2 gloo ranks, 8 steps (2026-12-01, this VM), bf16 1.45e-4 and
# fp16 1.3e-5 against bounds of 0.043 and 0.0054 (300x and 400x). A tied head or other weights
# move the losses by 0.1 and more from the first step.
FP32_ULPS = 20
_EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10, "float64": 2.0**-52}


def loss_gap_bound(dtype: str, baseline_losses: list[float]) -> float:
    """The largest |loss - FSDP2 loss| that rounding in `dtype` explains ([Note: the loss gap
    to the baseline])."""
    scale = max((abs(x) for x in baseline_losses), default=1.0)
    return (FP32_ULPS * _EPS["float32"] + _EPS.get(dtype, _EPS["float32"])) * scale


def loss_gap_warning(name: str, diff: float, steps: int, bound: float, dtype: str) -> str:
    return (f"{name}: max |loss - FSDP2 loss| = {diff:.3g} over {steps} steps, beyond what {dtype} rounding explains "
            f"({bound:.2g}): the two runs do not compute the same thing (other base weights, a tied head over untied "
            f"files, a config that does not fit the files?)")


# [Note: the NF4 peer's loss tolerance]
# The fsdp2-nf4 peer (torchao's NF4) and an elastic --weight-format nf4 run (bitsandbytes' NF4)
# quantize the same weights to nearly the same values, not the same ones: torchao's codebook is
# bitsandbytes' rounded to 4 decimals (a code at a bucket boundary can differ), and its block
# scales are always double-quantized, linearly to int8 in blocks of 256 around the weight's mean
# absmax, where bitsandbytes keeps fp32 absmax or (nested) an 8-bit dynamic code around the
# chunk's mean (tests/kernels/test_quant.py::test_nf4_close_to_torchao bounds the weights:
# >= 99% equal codes, values within 2% of the block's absmax). Their losses therefore differ by
# more than rounding, and by far less than NF4 differs from full precision:
#     bound = (NF4_LOSS_RTOL + eps(dtype)) x the largest peer loss compared
# (eps(dtype): one unit of a bf16/fp16 model's precision, as for the FSDP2 bound).
# Measured (2026-12-02, this VM, nested elastic nf4, the CLI's lr 2e-3 and alpha 16), as the
# largest gap over the steps, relative to the largest peer loss:
#   tiny (2 gloo ranks, hidden 256, intermediate 128, 2 layers, seq 24, 8 steps): elastic nf4
#     vs the peer 1.19e-3 (2.1e-4; not nested 6.4e-4), full-precision elastic vs the peer
#     2.4e-2 (4.3e-3);
#   the demo's NF4 shape (`make demo`'s third job: 4 ranks, intermediate 768, 8 KV heads, 30
#     steps): 5.3e-4 (9.6e-5; step 1 2.2e-4), full precision vs the peer 1.13e-2 (2.0e-3;
#     step 1 9.2e-3).
# NF4_LOSS_RTOL sits near the geometric mean of the largest NF4 gap and the smallest
# full-precision gap (6.5e-4): 2.8x above the one and 3.4x below the other, so a peer or a run
# that computed with full-precision weights is flagged and two NF4 implementations are not.
# Training amplifies a difference in the weights as it amplifies any other: with an aggressive
# step (lr 1e-2, alpha 64 on the tiny model) the loss jumped at step 3 in every run, and nested
# vs not-nested elastic nf4 alone differed by 0.43 afterwards, so a gap beyond the bound is a
# warning that names step 1's gap (before any update: the weights alone), never an error. The
# peer against a single-process model on torchao's dequantized weights is the same computation:
# fp32 rounding (tests/quant/test_fsdp2_nf4.py).
# On the real model (SmolLM2-135M-Instruct, 2 ranks, 3 steps, bench/results/
# 2026-12-03_make_demo_nf4.md) the two quantizers differ by more than 6e-4 of the loss: nested
# elastic nf4 vs the peer 3.1e-4, 5.6e-3, 5.8e-4 at steps 1-3, and two bitsandbytes encodings of
# the same run (nested vs not) already 3.7e-3 at step 1, while full precision vs nf4 differs by
# 0.32 at step 1. What separates "two NF4 implementations" from "another computation" is the
# quantization's own effect on this model, so when the job also ran full precision on the same
# batches the bound is at least NF4_FP_FRACTION of |full-precision loss - peer loss| at step 1
# (before any update: the weights alone). Measured ratios of the largest NF4 gap to that step-1
# effect: 0.017 on the real model (5.6e-3 / 0.32), 0.058 on the demo's former NF4 shape
# (5.3e-4 / 9.2e-3); 0.1 is 1.7x and 5.7x above them and 10x below a run computing with
# full-precision weights (a gap of the whole effect).
NF4_LOSS_RTOL = 6e-4
NF4_FP_FRACTION = 0.1

# The peer each weight format's runs are checked against: (run kind, its name in messages).
REFERENCE_PEERS = {"none": ("fsdp2", "FSDP2"), "nf4": ("fsdp2-nf4", "FSDP2-NF4")}


def numerics(run: dict) -> str:
    """The weight format a run computes with ("none", "nf4", "int8"): runs are compared within one."""
    return run.get("weight_format") or "none"


def nf4_gap_bound(dtype: str, peer_losses: list[float], full_precision_losses: list[float] | None = None) -> float:
    """The largest |loss - FSDP2-NF4 loss| two NF4 implementations explain ([Note: the NF4
    peer's loss tolerance]); with the losses of a full-precision run on the same batches, at
    least NF4_FP_FRACTION of the quantization's effect on the first loss."""
    scale = max((abs(x) for x in peer_losses), default=1.0)
    bound = (NF4_LOSS_RTOL + _EPS.get(dtype, _EPS["float32"])) * scale
    if full_precision_losses and peer_losses:
        bound = max(bound, NF4_FP_FRACTION * abs(full_precision_losses[0] - peer_losses[0]))
    return bound


def nf4_gap_warning(name: str, diff: float, steps: int, bound: float, first: float) -> str:
    return (f"{name}: max |loss - FSDP2-NF4 loss| = {diff:.3g} over {steps} steps, beyond the NF4 tolerance "
            f"({bound:.2g}: torchao's and bitsandbytes' NF4 of the same weights); step 1, before any update, differs "
            f"by {first:.3g}: if that is within the tolerance, training amplified the two quantizers' small "
            f"differences (a large learning rate?), else the runs do not quantize the same weights")


def _mib(b):
    return None if b is None else b / MiB


def memory_key(runs: list[dict]) -> str:
    """The figure runs are compared by: the tensor peak when every run has one (CPU runs of 3
    steps or more, every GPU run), else the peak memory of [Note: what "peak memory" means
    here] in measure.py; never a mix of the two."""
    if runs and all(r.get("tensor_peak_bytes") is not None for r in runs):
        return "tensor_peak_bytes"
    return "peak_memory_bytes"


def table_rows(runs: list[dict]) -> list[dict]:
    base = next((r for r in runs if r["kind"] == "fsdp2"), None)
    rows = []
    for r in runs:
        ratio = None
        if base is not None and base["tokens_per_s"] and r["tokens_per_s"]:
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
        rows.append({
            "run": r["name"] + (" (FAILED)" if r.get("status") == "failed" else ""),
            "tokens/s": r["tokens_per_s"],
            "tokens/s vs FSDP2": ratio,
            "peak memory MiB": _mib(r["peak_memory_bytes"]),
            "tensor peak MiB": _mib(r.get("tensor_peak_bytes")),
            "all-gather MiB/step (steady)": _mib(r["allgather_bytes_steady"]),
            "all-gather MiB (first step)": _mib(r["allgather_bytes_first_step"]),
            "host->device MiB/step (steady)": _mib(r.get("h2d_bytes_steady", 0)),
            "all-gathers/step (steady)": r.get("allgather_calls_steady"),
            "final train loss": r["final_loss"],
            "held-out loss": r["heldout_loss"],
        })
    return rows


def _fmt(column: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, str):
        return v
    if column in ("tokens/s", "all-gathers/step (steady)"):
        return f"{v:.0f}"
    if column == "tokens/s vs FSDP2":
        return f"{v:.2f}x"
    if "loss" in column:
        return f"{v:.4f}"
    return f"{v:.2f}"


def markdown_table(rows: list[dict]) -> str:
    out = io.StringIO()
    out.write("| " + " | ".join(COLUMNS) + " |\n")
    out.write("|" + "|".join("---" if c == "run" else "---:" for c in COLUMNS) + "|\n")
    for row in rows:
        out.write("| " + " | ".join(_fmt(c, row[c]) for c in COLUMNS) + " |\n")
    return out.getvalue()


def text_table(rows: list[dict]) -> str:
    cells = [[_fmt(c, row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths)))]
    for r in cells:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=COLUMNS)
    w.writeheader()
    for row in rows:
        w.writerow({c: ("" if row[c] is None else row[c]) for c in COLUMNS})
    return out.getvalue()


# What the peak-memory figure of a run of each kind holds (on CPU: rank 0's resident set above
# its level before the model was built; on GPU: torch's allocated tensors above that level).
MEMORY_HOLDS = {
    "elastic": "its shard of every frozen weight, the pool (up to its budget), activations, adapters, their "
               "gradients and AdamW state (below a full cache its share of the state)",
    "planned": "what the plan keeps: shards, the pool at the plan's budget, the activations it does not recompute, "
               "adapters, gradients, AdamW state",
    "sweep": "its shard of every frozen weight, the pool (up to its budget), the activations of every adapter's "
             "rows, every adapter, its gradients and AdamW state",
    "fsdp2": "its shard of every weight, the decoder layers gathered at a time (kept to backward when not "
             "resharded), activations, adapters, gradients, AdamW state",
    "deepspeed": "its partition of every weight and adapter, the parameters gathered at a time (prefetched, "
                 "persistent, or kept for reuse), the fp32 flat adapter partitions, their gradients, AdamW state, "
                 "the gradient bucket",
    "ddp": "the whole model, activations, adapters, gradients and DDP's gradient buckets, AdamW state",
    "fsdp2-nf4": "its shard of every weight (NF4 where the elastic run quantizes), the decoder layers gathered at a "
                 "time (packed NF4) and each weight dequantized for its GEMM, activations, adapters, gradients, "
                 "AdamW state",
}


def peer_notes(runs: list[dict], skipped: dict[str, str]) -> str:
    """Markdown lines under the table: peers left out; for each elastic run the fastest peer at
    no more memory; the largest loss difference from the elastic run; what each memory figure
    holds."""
    out = []
    for kind, why in skipped.items():
        out.append(f"--baseline {kind} left out: {why}")
    key = memory_key(runs)
    peer_points = [{"name": r["name"], "memory": r[key], "tokens_per_s": r["tokens_per_s"],
                    "weight_format": numerics(r)} for r in runs if r["kind"] not in ELASTIC_KINDS]
    if peer_points:
        for r in runs:
            mine = [p for p in peer_points if p["weight_format"] == numerics(r)]  # peers of its own numerics
            if r["kind"] not in ELASTIC_KINDS or not mine:
                continue
            best = best_peer_at_or_below(r[key], mine)
            if best is None:
                least = min((p["memory"] for p in mine if p["memory"] is not None), default=None)
                out.append(f"{r['name']}: no peer ran in its memory ({_fmt('m', _mib(r[key]))} MiB; "
                           f"the least a peer needed: {_fmt('m', _mib(least))} MiB)")
            elif r["tokens_per_s"] and best["tokens_per_s"]:
                out.append(f"{r['name']}: {r['tokens_per_s'] / best['tokens_per_s']:.2f}x the tokens/s of the fastest "
                           f"peer at no more memory ({best['name']}, {_mib(best['memory']):.1f} MiB)")
    for fmt in dict.fromkeys(numerics(r) for r in runs):  # one line per weight format, against its first run
        diffs = [(r["max_abs_loss_diff_vs_elastic"], r["name"]) for r in runs
                 if "max_abs_loss_diff_vs_elastic" in r and numerics(r) == fmt]
        if diffs:
            d, name = max(diffs)
            ref = next(r for r in runs if numerics(r) == fmt and "max_abs_loss_diff_vs_elastic" not in r)
            what = "full-precision" if fmt == "none" else fmt
            of = "any run" if len({numerics(r) for r in runs}) == 1 else f"any {what} run"
            out.append(f"largest |loss - {ref['name']} loss| of {of}, any step: {d:.3g} ({name})")
    peer_kinds = {kind for kind, _ in REFERENCE_PEERS.values()}
    alone = [r["name"] for r in runs if r["kind"] not in peer_kinds
             and any(k.startswith("loss_gap_vs_") for k in r)
             and all(str(v).startswith("not compared: other weights") for k, v in r.items() if k.startswith("loss_gap_vs_"))]
    if alone:
        out.append(f"no peer of their weights ran, so their losses are not compared with a peer (full precision and "
                   f"quantized weights differ by more than rounding): {', '.join(alone)}")
    if peer_points:
        kinds = list(dict.fromkeys(r["kind"] for r in runs))
        out.append("peak memory holds: " + "; ".join(f"{k}: {MEMORY_HOLDS[k]}" for k in kinds if k in MEMORY_HOLDS))
    measures = sorted({r["memory_measure"] for r in runs if r.get("memory_measure")})
    if measures:
        out.append(f"memory figures: 'peak memory' is the {' / '.join(measures)}; 'tensor peak' is the bytes of "
                   f"live tensors at their peak (CPU: the profiled last step, the pool counted once, the host store "
                   f"not counted; GPU: max_memory_allocated); runs are set against peers by "
                   f"{'tensor peak' if memory_key(runs) == 'tensor_peak_bytes' else 'peak memory'}")
    return "".join(f"\n{line}  " for line in out)


def losses_label(run: dict) -> str:
    """The name of a run's loss curve: its name, or for a run resumed at another pool budget
    the budget of each range of steps (`losses_label`, set by the CLI)."""
    return run.get("losses_label") or run["name"]


def _short_label(name: str) -> str:
    """'elastic, budget 0' -> 'budget 0'; 'DeepSpeed ZeRO-3 + PEFT (persistence 0)' -> 'persistence 0'."""
    if "(" in name and name.endswith(")"):
        return name[name.index("(") + 1:-1]
    return name.split(", ", 1)[-1]


def losses_csv(runs: list[dict]) -> str:
    """step, then one column per run: the loss of every optimizer step (repr: exact floats)."""
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["step"] + [losses_label(r) for r in runs])
    n = max((len(r["losses"]) for r in runs), default=0)
    for s in range(n):
        w.writerow([s + 1] + [repr(r["losses"][s]) if s < len(r["losses"]) else "" for r in runs])
    return out.getvalue()


def plot(runs: list[dict], path: str, caption: str) -> None:
    """Loss curves of every run, and bars for tokens/s, all-gather traffic and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {r["name"]: f"C{i}" for i, r in enumerate(runs)}
    systems = {system_of(r["kind"], numerics(r)) for r in runs}
    panels = 5 if len(systems) > 1 else 4  # the frontier panel when peers ran
    fig, axes = plt.subplots(1, panels, figsize=(17 + 4.5 * (panels - 4), 4.2),
                             gridspec_kw={"width_ratios": [2.2, 1, 1, 1] + [1.8] * (panels - 4)})
    ax = axes[0]
    for r in runs:
        steps = list(range(1, len(r["losses"]) + 1))
        style = "--" if r["kind"] in ("fsdp2", "fsdp2-nf4") else "-"
        ax.plot(steps, r["losses"], style, color=colors[r["name"]], label=losses_label(r), linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (global batch mean)")
    diffs = [r["max_abs_loss_diff_vs_fsdp2"] for r in runs if "max_abs_loss_diff_vs_fsdp2" in r]
    ax.set_title("loss" + (f" (elastic vs FSDP2: max |difference| {max(diffs):.2g})" if diffs else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    names = [r["name"] for r in runs]
    short = [n.replace(", ", "\n").replace(" (", "\n(") for n in names]
    bars = [
        ("tokens/s (steady state)", [r["tokens_per_s"] for r in runs], "{:.0f}"),
        ("all-gather MiB per step (steady)", [_mib(r["allgather_bytes_steady"]) for r in runs], "{:.2f}"),
        ("tensor peak MiB (rank 0)" if memory_key(runs) == "tensor_peak_bytes" else "peak memory MiB (rank 0)",
         [_mib(r[memory_key(runs)]) for r in runs], "{:.1f}"),
    ]
    for ax, (title, values, fmt) in zip(axes[1:4], bars):
        vals = [0.0 if v is None else v for v in values]
        rects = ax.bar(range(len(runs)), vals, color=[colors[n] for n in names])
        for rect, v in zip(rects, values):
            ax.annotate("n/a" if v is None else fmt.format(v), (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(short, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    if panels == 5:
        ax = axes[4]
        plot_frontier(ax, [{"system": system_of(r["kind"], numerics(r)), "label": _short_label(r["name"]),
                            "memory": r[memory_key(runs)], "tokens_per_s": r["tokens_per_s"]} for r in runs],
                      memory_label=("tensor peak" if memory_key(runs) == "tensor_peak_bytes" else "peak memory")
                      + " MiB (rank 0)")
        ax.set_title("tokens/s against peak memory; lines: each system's frontier", fontsize=10)
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


# ------------------------------------------------------------------ a sweep job (sweep.py)

SWEEP_COLUMNS = ("adapter", "lr", "lora-r", "lora-alpha", "lora-dropout", "seed", "final train loss", "held-out loss")


def sweep_summary(run: dict, comparison: dict | None) -> dict:
    """summary.json's "sweep": one row per adapter (its name, settings, losses, final and
    held-out loss), the job's aggregate tokens/s (every adapter's tokens) and, with
    --compare-sequential, the comparison ([Note: the sweep's sequential comparison])."""
    return {"adapters": run.get("adapters", []), "aggregate_tokens_per_s": run["tokens_per_s"],
            "tokens_per_step": run["tokens_per_step"],
            "allgather_bytes_per_step": run["allgather_bytes_per_step"], "compare_sequential": comparison}


def sweep_rows(sweep: dict) -> list[dict]:
    return [{"adapter": a["name"], **a["settings"], "final train loss": a["final_loss"],
             "held-out loss": a["heldout_loss"]} for a in sweep["adapters"]]


def _sweep_cell(column: str, v) -> str:
    if v is None:
        return "n/a"
    if "loss" in column:
        return f"{v:.4f}"
    return v if isinstance(v, str) else f"{v:g}"


def sweep_text(sweep: dict, markdown: bool = False) -> str:
    """The per-adapter table and the aggregate figures (and the comparison's), as text or markdown."""
    cells = [[_sweep_cell(c, row[c]) for c in SWEEP_COLUMNS] for row in sweep_rows(sweep)]
    if markdown:
        out = "| " + " | ".join(SWEEP_COLUMNS) + " |\n|---|" + "---:|" * (len(SWEEP_COLUMNS) - 1) + "\n"
        out += "".join("| " + " | ".join(r) + " |\n" for r in cells)
    else:
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(SWEEP_COLUMNS)]
        out = "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                        for r in [list(SWEEP_COLUMNS)] + cells) + "\n"
    k = len(sweep["adapters"])
    tps = sweep["aggregate_tokens_per_s"]
    lines = [f"sweep: {k} adapters in one job, aggregate {'n/a' if tps is None else format(tps, '.0f')} tokens/s "
             f"(every adapter's tokens: {sweep['tokens_per_step']} per step)"]
    c = sweep.get("compare_sequential")
    if c is not None:
        r = c["ratio_vs_sequential"]
        lines.append(f"compare-sequential: sweep {c['sweep_tokens_per_s']:.0f} tokens/s vs the {k} adapters one after "
                     f"another (elastic, same budget) {c['sequential_tokens_per_s']:.0f} tokens/s: "
                     f"{r['median']:.3f}x (median of {c['rounds_timed']} interleaved rounds, "
                     f"[{r['min']:.3f}, {r['max']:.3f}]; rounds {' '.join(f'{x:.3f}' for x in r['rounds'])})")
        for kind, p in c["peers"].items():
            lines.append(f"compare-sequential: sweep vs the {k} adapters one after another under {kind} "
                         f"({p['tokens_per_s']:.0f} tokens/s): {p['ratio']['median']:.3f}x "
                         f"[{p['ratio']['min']:.3f}, {p['ratio']['max']:.3f}]")
        d = c["max_abs_loss_diff_vs_sequential"]
        if d is not None:
            lines.append(f"compare-sequential: largest |sweep adapter loss - its sequential loss| {d:.3g}; all-gather "
                         f"bytes per step: sweep {statistics.median(c['sweep_allgather_bytes_per_step'][1:]):.0f}, one "
                         f"sequential adapter {statistics.median(c['sequential_allgather_bytes_per_adapter_step'][1:]):.0f}")
    return out + "".join(("\n" if markdown else "") + line + ("  \n" if markdown else "\n") for line in lines)


def sweep_losses_csv(sweep: dict) -> str:
    """step, then one column per adapter: its loss at every optimizer step (repr: exact floats)."""
    return losses_csv([{"name": a["name"], "losses": a["losses"]} for a in sweep["adapters"]])
