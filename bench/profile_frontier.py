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
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.bench_frontier as bf  # noqa: E402
from bench.harness import start_group  # noqa: E402


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from elastic_kernels.api.finetune.engines import ElasticEngine
    from elastic_kernels.api.finetune.job import prepare
    from elastic_kernels.api.finetune.measure import AllGatherCounter, fix_mmap_threshold
    from elastic_kernels.api.finetune.options import parse_args
    from elastic_kernels.api.loading.pretrained import pretrained_dir
    from elastic_kernels.api.nn import adapter_state_dict

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=14)
    own, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if own.profile_steps < 1 or own.top < 1:
        p.error("--profile-steps and --top must be >= 1")
    opts, extra = bf._parse(rest)
    fix_mmap_threshold()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="profile_frontier_")
    if opts.preset is not None:
        model_opts = bf.PRESETS[opts.preset]
    else:
        model_dir = opts.model if os.path.isdir(opts.model) else str(pretrained_dir(opts.model))
        model_opts = ["--model", model_dir] + bf.REAL_OPTIONS
    steps = 2 + own.profile_steps
    args = parse_args(model_opts + extra + ["--steps", str(steps), "--no-progress", "--overwrite",
                                            "--save-dir", os.path.join(tmp, f"rank{rank}")])
    job = prepare(args, rank, world, int(os.environ.get("LOCAL_RANK", "0")))
    os.makedirs(job.save_dir, exist_ok=True)
    start_group(job, args.timeout_s)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])
    with AllGatherCounter() as counter:
        seed = ElasticEngine(job, None)
        job.initial_adapters = {k: v.clone() for k, v in adapter_state_dict(seed.model).items()}
        del seed
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
            if rank == 0:
                print(f"=== {r.cfg.system} {r.cfg.label}: {own.profile_steps} steps in {wall:.2f} s (profiled)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=own.top,
                                                max_name_column_width=40), flush=True)
        for r in runners:
            r.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
