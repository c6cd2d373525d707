"""Profile frontier configurations side by side: where one step's time goes.

    torchrun --standalone --nproc-per-node 2 bench/profile_frontier.py \
        --budgets all --host-budgets '' --planned-caps 0 --peers ddp [--profile-steps 3] [--top 14]

Takes bench_frontier.py's options for which configurations to build (its `configurations`,
the same job: the real model by default, seq 128, micro-batch 1) and its Runner. Every
configuration is alive at once; two warm-up steps of each (the elastic runs learn their order
and fill their pools), then each configuration's --profile-steps steps under
torch.profiler (CPU activities; CUDA too on a GPU), one configuration after the other, each
after a barrier. Rank 0 prints the wall time of the profiled steps and the top ops by self
time. The profiler's overhead differs between configurations (one op record per call): the
table says where time goes within a configuration; speed ratios come from bench_frontier.py's
interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.bench_frontier as bf  # noqa: E402


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from elastic_kernels.api.finetune.measure import AllGatherCounter, fix_mmap_threshold

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=14)
    own, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if own.profile_steps < 1 or own.top < 1:
        p.error("--profile-steps and --top must be >= 1")
    opts, extra = bf._parse(rest)
    fix_mmap_threshold()
    tmp = tempfile.mkdtemp(prefix="profile_frontier_")
    steps = 2 + own.profile_steps
    job, _ = bf.start_job(opts, extra, steps, tmp)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])
    with AllGatherCounter() as counter:
        bf.seed_adapters(job)
        runners = [bf.Runner(job, c, counter) for c in bf.configurations(opts, job, counter)]
        for k in range(2):
            for r in runners:
                r.step(k)
        for r in runners:
            dist.barrier()
            t0 = time.perf_counter()
            with profile(activities=activities) as prof:
                for k in range(2, steps):
                    r.step(k)
            wall = time.perf_counter() - t0
            if job.rank == 0:
                print(f"=== {r.cfg.system} {r.cfg.label}: {own.profile_steps} steps in {wall:.2f} s (profiled)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=own.top,
                                                max_name_column_width=40), flush=True)
        for r in runners:
            r.close()
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
