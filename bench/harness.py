"""Shared benchmark harness: timing (median of repeats after warm-up) and result rows.

Every bench script measures its baseline in the same run as the candidate, reports ratios,
and appends one CSV row per measurement to ``bench/results/<bench>.csv`` (or to the folder
given by ``--results`` / $ELASTIC_BENCH_RESULTS, which `make gpu-check` points at $OUT).
Each row carries the device, date, torch and package versions and the git commit.
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
import time
from typing import Callable

import torch

from elastic_kernels.api.finetune.measure import device_name  # noqa: F401 - shared with the fine-tuning CLI

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def start_group(job, timeout_s: float) -> None:
    """The process group of a benchmark's prepared fine-tuning job (`prepare` of
    python_api/finetune/job.py): the job's CUDA device made current, NCCL on a GPU and gloo on
    CPU with the job's collective timeout, and the job's peak-memory probe."""
    import torch.distributed as dist

    from elastic_kernels.api.finetune.measure import PeakMemory

    device = job.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    job.memory = PeakMemory(device)


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device="cpu", *, warmup: int = 3, repeats: int = 11) -> float:
    """Median wall time of `fn()` in seconds, over `repeats` runs after `warmup` runs.

    On CUDA the device is synchronised around each run, so the time covers the kernels.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def context(device) -> dict:
    """The columns every row starts with."""
    try:
        from importlib.metadata import version

        pkg = version("elastic-kernels")
    except Exception:  # noqa: BLE001 - not installed: running from a source tree
        pkg = "source"
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "torch": torch.__version__,
        "elastic_kernels": pkg,
        "commit": _git_commit(),
    }


def results_dir(cli_value: str | None = None) -> str:
    return cli_value or os.environ.get("ELASTIC_BENCH_RESULTS") or RESULTS_DIR


def append_rows(bench: str, rows: list[dict], out_dir: str | None = None) -> str:
    """Append rows to <out_dir>/<bench>.csv; the header is written when the file is new and
    must match when it is not (a changed schema gets a new file name, never a silent mix)."""
    if not rows:
        raise ValueError("append_rows: no rows to write")
    out_dir = results_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{bench}.csv")
    fields = list(rows[0].keys())
    for row in rows:
        if list(row.keys()) != fields:
            raise ValueError(f"append_rows: rows of {bench} have different columns: {list(row)} vs {fields}")
    exists = os.path.exists(path) and os.path.getsize(path) > 0
    if exists:
        with open(path, newline="") as f:
            header = next(csv.reader(f))
        if header != fields:
            raise ValueError(f"{path} has columns {header}, this run writes {fields}; use a new bench name")
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if not exists:
            w.writeheader()
        w.writerows(rows)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
