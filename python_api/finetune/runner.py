"""run(): the runs of a job (the elastic run, the extra budgets, the FSDP2 baseline), the
summary, and the report rank 0 writes."""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist

from python_api.finetune import report
from python_api.finetune.checkpoints import CKPT
from python_api.finetune.constants import PROG
from python_api.finetune.engines import ElasticEngine, FSDP2Engine
from python_api.finetune.files import (
    agreed_write,
    local_now,
    write_bytes_atomic,
    write_json,
    write_text_atomic,
)
from python_api.finetune.job import Job
from python_api.finetune.measure import AllGatherCounter, PeakMemory, device_name
from python_api.finetune.pipelined import (
    PipelinedEngine,
    close_engine,
    engine_adapters,
    primary_engine,
    save_engine_adapter,
    train_engine,
)


def run(job: Job) -> dict:
    """The whole job on every rank; rank 0 writes the report. Returns the summary."""
    args = job.args
    job.memory = PeakMemory(job.device)
    runs = []
    if job.rank == 0:
        print(f"{PROG}: {job.spec.description()}; {job.world_size} ranks on {job.device.type} "
              f"({dist.get_backend()}); data {job.data_info['source']}, {job.data_info['tokens']} tokens; "
              f"{job.world_size * args.micro_batch * args.grad_accum} sequences x {args.seq_len} tokens per step; "
              f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on {len(job.targets)} modules; output {job.save_dir}",
              flush=True)
        if job.resume is not None:
            print(f"{PROG}: resuming from {job.resume.path} at step {job.resume.step}", flush=True)
    with AllGatherCounter() as counter:
        # 1. the elastic run (checkpointed, its adapter exported)
        job.memory.set_baseline()
        engine = primary_engine(job)  # pipelined with --pp > 1 (python_api/finetune/pipelined.py)
        # A copy: adapter_state_dict's CPU tensors share storage with the parameters.
        job.initial_adapters = engine_adapters(engine)
        result = train_engine(job, engine, counter, primary=True)
        save_engine_adapter(job, engine, os.path.join(job.save_dir, "adapter"), "the trained adapter was not saved")
        probe_logits = result.pop("probe_logits")

        def probe():
            if job.rank == 0:
                from safetensors.torch import save_file

                write_bytes_atomic(os.path.join(job.save_dir, "probe.safetensors"), lambda p: save_file(
                    {"input_ids": job.windows.probe.contiguous(), "logits": probe_logits.contiguous()}, p))

        agreed_write(job, probe, "the probe batch was not saved")  # also the barrier after the elastic run
        runs.append(result)
        close_engine(engine)
        del engine
        gc.collect()
        # 2. the comparisons, each from scratch: more elastic budgets, the weights in the host
        # store, a planned run, the FSDP2 baseline
        builds = [lambda b=b: ElasticEngine(job, b) for b in args.compare_budgets]
        if args.compare_host:
            builds.append(lambda: ElasticEngine(job, args.pool_budget, weights_on="host"))
        if args.compare_planned:
            builds.append(lambda: ElasticEngine(job, args.pool_budget, weights_on="device", planned=True))
        if args.compare_pp is not None:
            builds.append(lambda: PipelinedEngine(job, args.compare_pp))
        if args.baseline == "fsdp2":
            builds.append(lambda: FSDP2Engine(job, counter))
        for build in builds:
            job.memory.set_baseline()
            engine = build()
            runs.append(train_engine(job, engine, counter, primary=False))
            close_engine(engine)
            del engine
            gc.collect()
            dist.barrier()
    summary = _summary(job, runs)
    agreed_write(job, lambda: _write_report(job, runs, summary) if job.rank == 0 else None,
                "the report was not written (the adapter and checkpoint were)")
    return summary


def _summary(job: Job, runs: list[dict]) -> dict:
    base = next((r for r in runs if r["kind"] == "fsdp2"), None)
    for r in runs:
        if base is not None and r is not base:
            n = min(len(r["losses"]), len(base["losses"]))
            r["max_abs_loss_diff_vs_fsdp2"] = max(abs(a - b) for a, b in zip(r["losses"][:n], base["losses"][:n]))
            r["steps_compared_with_fsdp2"] = n
    return {
        "command": " ".join([PROG] + sys.argv[1:]) if job.args._argv is None else " ".join([PROG] + job.args._argv),
        "date": local_now(),
        "machine": device_name(job.device),
        "world_size": job.world_size,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "model": job.spec.description(),
        "data": job.data_info,
        "config": job.config,
        "save_dir": job.save_dir,
        "resumed_from": job.resume.path if job.resume is not None else None,
        "runs": runs,
    }


def _write_report(job: Job, runs: list[dict], summary: dict) -> None:
    d = job.save_dir
    rows = report.table_rows(runs)
    args = job.args
    caption = (f"{summary['date'][:10]} · {summary['machine']} · {job.world_size} ranks ({summary['backend']}) · "
               f"{job.spec.description()} · {job.world_size * args.micro_batch * args.grad_accum}x{args.seq_len} "
               f"tokens/step · LoRA r={args.lora_r}")
    md = (f"Command: `{summary['command']}`  \n"
          f"Date: {summary['date']}; machine: {summary['machine']}; {job.world_size} ranks, {summary['backend']}; "
          f"torch {summary['torch']}  \n"
          f"Model: {summary['model']}; data: {job.data_info['source']} ({job.data_info['tokens']} tokens)\n\n"
          + report.markdown_table(rows))
    for r in runs:
        if "max_abs_loss_diff_vs_fsdp2" in r:
            md += (f"\n{r['name']}: max |loss - FSDP2 loss| over {r['steps_compared_with_fsdp2']} steps = "
                   f"{r['max_abs_loss_diff_vs_fsdp2']:.3g}  ")
    md += "\n"
    write_text_atomic(os.path.join(d, "results.md"), md)
    write_text_atomic(os.path.join(d, "results.csv"), report.csv_text(rows))
    write_text_atomic(os.path.join(d, "losses.csv"), report.losses_csv(runs))
    write_json(os.path.join(d, "summary.json"), summary)
    png = os.path.join(d, "finetune.png")
    write_bytes_atomic(png, lambda p: report.plot(runs, p, caption))
    print()
    print(report.text_table(rows), end="")
    for r in runs:
        if "max_abs_loss_diff_vs_fsdp2" in r:
            print(f"{r['name']}: max |loss - FSDP2 loss| = {r['max_abs_loss_diff_vs_fsdp2']:.3g}")
    print(f"\ntable:   {os.path.join(d, 'results.md')} (and results.csv)")
    print(f"picture: {png}")
    print(f"adapter: {os.path.join(d, 'adapter')} (PEFT format)")
    print(f"checkpoint: {os.path.join(d, CKPT)}; losses: {os.path.join(d, 'losses.csv')}; all figures: {os.path.join(d, 'summary.json')}")
