"""Wall and CPU time of one command run in two checkouts of the repository, interleaved.

    python bench/ab_checkouts.py OLD_DIR NEW_DIR --rounds 6 -- COMMAND...

Round k runs OLD then NEW, round k+1 NEW then OLD; each run is `COMMAND` in a fresh process
with the checkout as its working directory and first on PYTHONPATH (so `elastic_kernels` and,
through a link `elastic_kernels/api -> ../python_api` in a checkout that is not the editable
install, `elastic_kernels.api` come from it). Prints each run's wall and CPU seconds (user +
sys of the command and every process it waited for: less sensitive to other jobs than the
wall time) and, for both, the median of the per-round ratios new/old with [min, max] and the
median seconds saved. Absolute times on a shared machine are noise; ratios of interleaved runs
are the figure.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def run(checkout: str, command: list[str], timeout: float) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + sys of the command and every process it waited for)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = checkout + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=600.0)
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("the command follows --")
    cut = argv.index("--")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    ratios, saved, cpu_ratios, cpu_saved = [], [], [], []
    for k in range(args.rounds):
        order = (("old", args.old), ("new", args.new))
        times, cpu = {}, {}
        for name, checkout in order if k % 2 == 0 else order[::-1]:
            times[name], cpu[name] = run(checkout, command, args.timeout)
        ratios.append(times["new"] / times["old"])
        saved.append(times["old"] - times["new"])
        cpu_ratios.append(cpu["new"] / cpu["old"])
        cpu_saved.append(cpu["old"] - cpu["new"])
        load = os.getloadavg()[0]
        print(f"round {k}: wall old {times['old']:.2f} s new {times['new']:.2f} s new/old {ratios[-1]:.3f}; "
              f"CPU old {cpu['old']:.2f} s new {cpu['new']:.2f} s new/old {cpu_ratios[-1]:.3f}; load {load:.1f}",
              flush=True)
    for what, r, d in (("wall", ratios, saved), ("CPU", cpu_ratios, cpu_saved)):
        print(f"{what} new/old: median {statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] over {args.rounds} "
              f"rounds; saved: median {statistics.median(d):.2f} s [{min(d):.2f}, {max(d):.2f}]")


if __name__ == "__main__":
    main()
