"""The fine-tuning CLI's report: one table (stdout, markdown, CSV) and one picture (PNG).

Each run is a dict with at least: name, tokens_per_s, peak_memory_bytes, allgather_bytes_steady,
allgather_bytes_first_step, final_loss, heldout_loss, losses (one per optimizer step, index =
step). The baseline (if any) is the run whose kind is "fsdp2"; ratios are against it.
"""

from __future__ import annotations

import csv
import io
import math

MiB = 2**20

COLUMNS = [
    "run",
    "tokens/s",
    "tokens/s vs FSDP2",
    "peak memory MiB",
    "all-gather MiB/step (steady)",
    "all-gather MiB (first step)",
    "host->device MiB/step (steady)",
    "final train loss",
    "held-out loss",
]


def _mib(b):
    return None if b is None else b / MiB


def table_rows(runs: list[dict]) -> list[dict]:
    base = next((r for r in runs if r["kind"] == "fsdp2"), None)
    rows = []
    for r in runs:
        ratio = None
        if base is not None and base["tokens_per_s"]:
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
        rows.append({
            "run": r["name"],
            "tokens/s": r["tokens_per_s"],
            "tokens/s vs FSDP2": ratio,
            "peak memory MiB": _mib(r["peak_memory_bytes"]),
            "all-gather MiB/step (steady)": _mib(r["allgather_bytes_steady"]),
            "all-gather MiB (first step)": _mib(r["allgather_bytes_first_step"]),
            "host->device MiB/step (steady)": _mib(r.get("h2d_bytes_steady", 0)),
            "final train loss": r["final_loss"],
            "held-out loss": r["heldout_loss"],
        })
    return rows


def _fmt(column: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, str):
        return v
    if column == "tokens/s":
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


def losses_label(run: dict) -> str:
    """The name of a run's loss curve: its name, or for a run resumed at another pool budget
    the budget of each range of steps (`losses_label`, set by the CLI)."""
    return run.get("losses_label") or run["name"]


def losses_csv(runs: list[dict]) -> str:
    """step, then one column per run: the loss of every optimizer step (repr: exact floats)."""
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["step"] + [losses_label(r) for r in runs])
    n = max(len(r["losses"]) for r in runs)
    for s in range(n):
        w.writerow([s + 1] + [repr(r["losses"][s]) if s < len(r["losses"]) else "" for r in runs])
    return out.getvalue()


def plot(runs: list[dict], path: str, caption: str) -> None:
    """Loss curves of every run, and bars for tokens/s, all-gather traffic and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {r["name"]: f"C{i}" for i, r in enumerate(runs)}
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1, 1]})
    ax = axes[0]
    for r in runs:
        steps = list(range(1, len(r["losses"]) + 1))
        style = "--" if r["kind"] == "fsdp2" else "-"
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
        ("peak memory MiB (rank 0)", [_mib(r["peak_memory_bytes"]) for r in runs], "{:.1f}"),
    ]
    for ax, (title, values, fmt) in zip(axes[1:], bars):
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
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
