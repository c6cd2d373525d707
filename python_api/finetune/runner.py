"""run(): the runs of a job (the elastic run, the extra budgets, the peers of --baseline), the
summary, and the report rank 0 writes."""

from __future__ import annotations

import gc
import os
import sys
import uuid

import torch
import torch.distributed as dist

from ..distributed.agree import exchange
from . import peers, report
from .checkpoints import CKPT
from .configuration import CONFIG_FILE
from .constants import PROG
from .engines import ElasticEngine
from .errors import FinetuneError
from .files import (
    agreed_write,
    local_now,
    write_bytes_atomic,
    write_json,
    write_text_atomic,
)
from .job import Job
from .loop import train
from .measure import AllGatherCounter, PeakMemory, device_name
from .option_values import budget_label
from .pipeline_layout import compare_pp_repeats_main
from .pipelined import PipelinedEngine, primary_engine
from .sweep import ADAPTERS_DIR, SweepEngine, compare_sequential, sweep_adapters


def comparison_builds(job: Job, counter, skipped: dict[str, str] | None = None) -> list[tuple[str, object]]:
    """The comparison runs of the job, each trained from scratch after the main run: (what,
    a function building its engine): more elastic budgets, other weight formats (--compare-format,
    at the main and those budgets), the weights in the host store (not
    when the main run has them there already: [Note: options a run ignores]), a planned run,
    the peers of --baseline (same seed, initial adapters and batches)."""
    pc, budget, pipeline = job.cfg.peers, job.cfg.elastic.pool_budget, job.cfg.pipeline
    builds = [(f"elastic, budget {budget_label(b)}", lambda b=b: ElasticEngine(job, b)) for b in pc.compare_budgets]
    for fmt in pc.compare_formats:  # the job in another weight format, at the main and the compared budgets
        builds += [(f"elastic {fmt}, budget {budget_label(b)}", lambda b=b, fmt=fmt: ElasticEngine(job, b, weight_format=fmt))
                   for b in [budget] + list(pc.compare_budgets)]
    if pc.compare_host and job.cfg.host.weights_on != "host":
        builds.append(("weights on host", lambda: ElasticEngine(job, budget, weights_on="host")))
    if pc.compare_planned:
        builds.append(("planned", lambda: ElasticEngine(job, budget, weights_on="device", planned=True)))
    # --compare-pp of the main run's degree is the same run: [Note: options a run ignores]
    if pipeline.compare_pp is not None and not compare_pp_repeats_main(pipeline, job.cfg.planner):
        builds.append((f"pipelined, pp {pipeline.compare_pp}",
                       lambda: PipelinedEngine(job, pipeline.compare_pp, option="--compare-pp")))
    for kind in pc.baselines:  # the peers, in the order given; those not installed left out
        if kind not in (skipped or {}):
            builds.append((kind, lambda kind=kind: peers.build(job, kind, counter)))
    return builds


def run(job: Job) -> dict:
    """The whole job on every rank; rank 0 writes the report. Returns the summary. A run that
    fails after training steps leaves its report, marked as failed ([Note: a run that fails
    after training steps])."""
    t, lora, out = job.cfg.training, job.cfg.lora, job.cfg.output
    job.memory = PeakMemory(job.device)
    runs: list[dict] = []
    sweep, comparison, probe_logits = bool(t.sweep), None, None
    if job.run_id is None:  # a fresh run: rank 0's id for every rank ([Note: the checkpoint's manifest])
        job.run_id = exchange(uuid.uuid4().hex, what="the run's id")[0]
    if job.rank == 0:
        print(f"{PROG}: {job.spec.description()}; tokenizer {job.spec.tokenizer.name}; {job.world_size} ranks on "
              f"{job.device.type} "
              f"({dist.get_backend()}); data {data_line(job.data_info)}; "
              f"{job.world_size * t.micro_batch * t.grad_accum} sequences x {t.seq_len} tokens per step; "
              f"LoRA r={lora.lora_r} alpha={lora.lora_alpha:g} on {len(job.targets)} modules; lr {t.lr:g} "
              f"{t.lr_schedule}, warm-up {t.warmup_steps} steps; output {job.save_dir}",
              flush=True)
        _warn(job.notices)
        if t.sweep:
            names = [a.name for a in sweep_adapters(job.cfg)]
            print(f"{PROG}: sweep of {len(names)} adapters on the same batches: {', '.join(names)}", flush=True)
        if job.resume is not None:
            print(f"{PROG}: resuming from {job.resume.path} at step {job.resume.step}", flush=True)
    # Before any run: peer settings no peer can run stop every rank; a peer not installed is
    # left out on every rank, and said so (python_api/finetune/peers/__init__.py).
    skipped = peers.check(job) if job.cfg.peers.baselines else {}
    if job.rank == 0:
        for kind, why in skipped.items():
            print(f"{PROG}: --baseline {kind} left out: {why}", flush=True)
    try:
        with AllGatherCounter() as counter:
            # 1. the elastic run (checkpointed, its adapter exported)
            job.memory.set_baseline()
            if sweep:  # K adapters in one job, no checkpoint ([Note: a sweep job] in sweep.py)
                engine = SweepEngine(job, job.cfg.elastic.pool_budget)
                result = train(job, engine, counter, primary=False)
                # the job's row: aggregate tokens/s; its losses the adapters' mean (one row each below it)
                result["name"] = f"{engine.name} (losses: their mean)"
                runs.append(result)
                engine.save_adapter(job, os.path.join(job.save_dir, ADAPTERS_DIR), "the trained adapters were not saved")
            else:
                engine = primary_engine(job)  # pipelined with --pp > 1 (python_api/finetune/pipelined.py)
                job.initial_adapters = engine.adapters()  # a copy, what the comparisons start from
                result = train(job, engine, counter, primary=True)
                probe_logits = result.pop("probe_logits")
                runs.append(result)
                engine.save_adapter(job, os.path.join(job.save_dir, "adapter"), "the trained adapter was not saved")

            if out.sample_tokens and not sweep:
                agreed_write(job, lambda: _reload_and_sample(job), "the saved adapter could not be reloaded")

            def probe():
                if job.rank == 0 and out.save_probe:
                    from safetensors.torch import save_file

                    write_bytes_atomic(os.path.join(job.save_dir, "probe.safetensors"), lambda p: save_file(
                        {**{k: v.clone() for k, v in job.windows.probe_inputs().items()},  # text: labels is input_ids
                         "logits": probe_logits.contiguous()}, p))

            agreed_write(job, probe, "the probe batch was not saved")  # also the barrier after the elastic run
            engine.close()
            del engine
            gc.collect()
            # 2. the comparisons, each from scratch
            if sweep and job.cfg.peers.compare_sequential:
                comparison = compare_sequential(job, counter, skipped, _rank0_print(job))
                gc.collect()
            for _, build in ([] if sweep else comparison_builds(job, counter, skipped)):
                job.memory.set_baseline()
                engine = build()
                runs.append(train(job, engine, counter, primary=False))
                engine.close()  # DeepSpeed's engine and a pipeline release their hooks and buffers
                del engine
                gc.collect()
                dist.barrier()
    except BaseException as exc:
        partial = getattr(exc, "partial_run", None)
        _write_failure_report(job, runs + ([partial] if partial is not None else []), exc, skipped)
        raise
    summary = _summary(job, runs, skipped)
    if sweep:
        summary["sweep"] = report.sweep_summary(runs[0], comparison)

    def write():
        if job.rank == 0:
            _write_configuration(job)
            _write_report(job, runs, summary)

    agreed_write(job, write,
                "the report was not written (the adapter and checkpoint were)")
    return summary


def data_line(info: dict) -> str:
    """The data in one phrase (the header, results.md)."""
    if info.get("format", "text") == "text":
        return f"{info['source']}, {info['tokens']} tokens"
    return (f"{info['source']}: {info['records']} {info['format']} records (+{info['heldout_records']} held out), loss "
            f"on {'assistant/completion tokens' if info['loss_on'] == 'assistant' else 'every token'}, "
            f"{info['layout']} into {info['rows']} rows ({info['row_fill']:.0%} real tokens), "
            f"{info['truncated_records']} record(s) truncated at --seq-len"
            + (f", {info['dropped_records']} dropped (nothing left to train)" if info['dropped_records'] else ""))


def _reload_and_sample(job: Job) -> None:
    """Rank 0: the adapter reloaded with PEFT, the held-out loss before and after and the
    samples ([Note: the held-out loss before and after, and the samples] in samples.py)."""
    if job.rank != 0:
        return
    from .samples import reload_and_sample

    try:
        job.samples = reload_and_sample(job, os.path.join(job.save_dir, "adapter"))
    except Exception as exc:  # noqa: BLE001 - one line on every rank (agreed_write), not a traceback on one
        raise FinetuneError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}") from exc
    s = job.samples
    print(f"{PROG}: held-out loss {s['heldout_loss_before']:.4f} before training, {s['heldout_loss_reloaded']:.4f} "
          f"after (the saved adapter reloaded with PEFT)", flush=True)
    for smp in s["samples"]:
        print(f"{PROG}: sample ({s['sample_tokens']} greedy tokens) {smp['prompt']!r}\n  before: {smp['before']!r}\n"
              f"  after:  {smp['after']!r}", flush=True)


def _rank0_print(job: Job):
    def show(line: str) -> None:
        if job.rank == 0:
            print(f"{PROG}: {line}", flush=True)
    return show


def _warn(lines: list[str]) -> None:
    """One line per warning on stderr (rank 0 calls it)."""
    for line in lines:
        sys.stderr.write(f"{PROG}: warning: {line}\n")
    sys.stderr.flush()


# [Note: a run that fails after training steps]
# An error after some steps were trained (a non-finite loss, a failed write, a re-plan that
# finds nothing, a peer that died) used to end the process with no losses.csv or summary.json:
# the steps were trained for nothing. train() attaches what it measured to the exception
# (`partial_run`), and run() has rank 0 write losses.csv, summary.json ("status": "failed",
# the error) and results.md from the runs that finished and that partial run, then re-raises.
# These writes are local to rank 0 and take no collective (the error may be a collective that
# failed); a write that fails then is reported on stderr and does not hide the error. An error
# before the first step of this process writes nothing, as before (docs/cli.md: bad input writes
# nothing). The last checkpoint is whatever the cadence wrote; none is written here.

def _error_text(exc: BaseException) -> str:
    if isinstance(exc, FinetuneError):
        return str(exc)
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _write_failure_report(job: Job, runs: list[dict], exc: BaseException, skipped: dict[str, str]) -> None:
    if job.rank != 0 or not any(r.get("steps_run") for r in runs):
        return
    try:
        summary = _summary(job, runs, skipped, error=_error_text(exc))
        d = job.save_dir
        write_text_atomic(os.path.join(d, "losses.csv"), report.losses_csv(runs))
        write_json(os.path.join(d, "summary.json"), summary)
        _write_configuration(job)
        write_text_atomic(os.path.join(d, "results.md"), _markdown(job, runs, summary))
        sys.stderr.write(f"{PROG}: the run failed after {sum(r.get('steps_run', 0) for r in runs)} trained step(s); "
                         f"what it trained is in {os.path.join(d, 'losses.csv')} and {os.path.join(d, 'summary.json')} "
                         f"(status failed)\n")
    except Exception as write_exc:  # noqa: BLE001 - the run's own error is what must reach the user
        sys.stderr.write(f"{PROG}: the run failed, and its partial report could not be written either: "
                         f"{type(write_exc).__name__}: {write_exc}\n")
    sys.stderr.flush()


def _summary(job: Job, runs: list[dict], skipped: dict[str, str] | None = None, error: str | None = None) -> dict:
    """Every figure of the job's runs; "status" complete or failed (with the error); "warnings":
    the options this job ignores ([Note: options a run ignores]) and every loss gap to the peer
    of the run's own weights beyond what explains it: FSDP2 for full-precision runs, rounding
    ([Note: the loss gap to the baseline] in report.py); FSDP2-NF4 for nf4 runs, the NF4
    tolerance ([Note: the NF4 peer's loss tolerance]). A run is never compared with a peer of
    other weights: it is said so."""
    warnings = list(job.notices)
    dtype = job.cfg.model.dtype
    for fmt, (kind, label) in report.REFERENCE_PEERS.items():
        base = next((r for r in runs if r["kind"] == kind and r.get("steps_run")), None)
        if base is None:
            continue
        key = kind.replace("-", "_")
        for r in runs:
            if r is base:
                continue
            if report.numerics(r) != fmt:
                r[f"loss_gap_vs_{key}"] = (f"not compared: other weights ({report.numerics(r)}; {label} trains "
                                           f"{'full-precision' if fmt == 'none' else fmt} ones)")
                continue
            n = min(len(r["losses"]), len(base["losses"]))
            if n == 0:
                continue
            diff = max(abs(a - b) for a, b in zip(r["losses"][:n], base["losses"][:n]))
            r[f"max_abs_loss_diff_vs_{key}"] = diff
            r[f"steps_compared_with_{key}"] = n
            if job.cfg.lora.lora_dropout > 0:
                r[f"loss_gap_vs_{key}"] = "not compared: LoRA dropout draws other masks in each run"
                continue
            if fmt == "none":
                bound = report.loss_gap_bound(dtype, base["losses"][:n])
                r["loss_gap_bound"] = bound
                r[f"loss_gap_vs_{key}"] = "beyond rounding" if diff > bound else "within rounding"
                if diff > bound:
                    warnings.append(report.loss_gap_warning(r["name"], diff, n, bound, dtype))
            else:
                fp = next((x for x in runs if x["kind"] == report.REFERENCE_PEERS["none"][0] and x.get("losses")), None)
                bound = report.nf4_gap_bound(dtype, base["losses"][:n], fp["losses"] if fp else None)
                r["loss_gap_bound"] = bound
                r[f"loss_gap_vs_{key}"] = "beyond the NF4 tolerance" if diff > bound else "within the NF4 tolerance"
                if diff > bound:
                    first = abs(r["losses"][0] - base["losses"][0])
                    warnings.append(report.nf4_gap_warning(r["name"], diff, n, bound, first))
    firsts = {}  # the first run of each weight format: what the others of that format are set against
    for r in runs:
        ref = firsts.setdefault(report.numerics(r), r)
        if r is not ref and r["losses"] and ref["losses"]:
            n = min(len(r["losses"]), len(ref["losses"]))
            r["max_abs_loss_diff_vs_elastic"] = max(abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
    return {
        "status": "failed" if error is not None else "complete",
        "run_id": job.run_id,
        "error": error,
        "warnings": warnings,
        "command": " ".join([PROG] + (sys.argv[1:] if job.cfg.argv is None else list(job.cfg.argv))),
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
        "heldout": getattr(job, "samples", None),
        "skipped_baselines": skipped or {},
    }


def _markdown(job: Job, runs: list[dict], summary: dict) -> str:
    """results.md: the command, the table, the loss gaps to FSDP2, the warnings (and the error
    of a failed job)."""
    md = (f"Command: `{summary['command']}`  \n"
          f"Date: {summary['date']}; machine: {summary['machine']}; {job.world_size} ranks, {summary['backend']}; "
          f"torch {summary['torch']}  \n"
          f"Model: {summary['model']}; tokenizer: {job.spec.tokenizer.name}; data: {data_line(job.data_info)}\n\n")
    if summary["status"] == "failed":
        md += f"**FAILED**: {summary['error']} (the table shows what was trained before it)\n\n"
    md += report.markdown_table(report.table_rows(runs))
    if summary.get("sweep"):
        md += "\n" + report.sweep_text(summary["sweep"], markdown=True)
    for line in _gap_lines(runs):
        md += f"\n{line}  "
    md += report.peer_notes(runs, summary["skipped_baselines"])
    md += _samples_markdown(getattr(job, "samples", None), runs)
    for w in summary["warnings"]:
        md += f"\n\n**Warning**: {w}"
    return md + "\n"


def _samples_markdown(s: dict | None, runs: list[dict]) -> str:
    """The held-out loss before and after, and the samples, for results.md."""
    if not s:
        return ""
    main = next((r for r in runs if r.get("heldout_loss") is not None), None)
    md = (f"\n\nHeld-out loss: {s['heldout_loss_before']:.4f} before training (the base model: every run starts "
          f"there), {s['heldout_loss_reloaded']:.4f} after (the saved adapter reloaded with PEFT"
          + (f"; the elastic run measured {main['heldout_loss']:.4f}" if main else "") + ")")
    for smp in s["samples"]:
        md += (f"\n\nSample ({s['sample_tokens']} greedy tokens, rank 0): *{smp['prompt']}*  \n"
               f"before: {smp['before']!r}  \nafter: {smp['after']!r}")
    return md


def _gap_lines(runs: list[dict]) -> list[str]:
    """One line per run compared with the peer of its weights: the largest loss gap and its verdict."""
    out = []
    for kind, label in report.REFERENCE_PEERS.values():
        key = kind.replace("-", "_")
        for r in runs:
            if f"max_abs_loss_diff_vs_{key}" in r:
                out.append(f"{r['name']}: max |loss - {label} loss| over {r[f'steps_compared_with_{key}']} steps = "
                           f"{r[f'max_abs_loss_diff_vs_{key}']:.3g} ({r[f'loss_gap_vs_{key}']})")
    return out


def _write_configuration(job: Job) -> None:
    """configuration.json: the run's configuration, resolved ([Note: configuration as types])."""
    write_text_atomic(os.path.join(job.save_dir, CONFIG_FILE), job.cfg.to_json() + "\n")


def _write_report(job: Job, runs: list[dict], summary: dict) -> None:
    d = job.save_dir
    rows = report.table_rows(runs)
    t = job.cfg.training
    caption = (f"{summary['date'][:10]} · {summary['machine']} · {job.world_size} ranks ({summary['backend']}) · "
               f"{job.spec.description()} · {job.world_size * t.micro_batch * t.grad_accum}x{t.seq_len} "
               f"tokens/step · LoRA r={job.cfg.lora.lora_r}")
    write_text_atomic(os.path.join(d, "results.md"), _markdown(job, runs, summary))
    write_text_atomic(os.path.join(d, "results.csv"), report.csv_text(rows))
    sweep = summary.get("sweep")
    write_text_atomic(os.path.join(d, "losses.csv"),
                      report.sweep_losses_csv(sweep) if sweep else report.losses_csv(runs))
    write_json(os.path.join(d, "summary.json"), summary)
    png = os.path.join(d, "finetune.png")
    write_bytes_atomic(png, lambda p: report.plot(runs, p, caption))
    print()
    print(report.text_table(rows), end="")
    if sweep:
        print()
        print(report.sweep_text(sweep), end="")
    for line in _gap_lines(runs):
        print(line)
    for w in summary["warnings"][len(job.notices):]:
        print(f"WARNING: {w}")
    notes = report.peer_notes(runs, summary["skipped_baselines"])
    if notes:
        print(notes.replace("  \n", "\n").strip())
    print(f"\ntable:   {os.path.join(d, 'results.md')} (and results.csv)")
    print(f"picture: {png}")
    if sweep:
        print(f"adapters: {os.path.join(d, ADAPTERS_DIR)}/NAME/ for each (PEFT format: "
              f"PeftModel.from_pretrained(base, DIR) loads one)")
        print(f"losses (one column per adapter): {os.path.join(d, 'losses.csv')}; all figures: "
              f"{os.path.join(d, 'summary.json')} (no checkpoint: a sweep job is not resumed)")
        return
    print(f"adapter: {os.path.join(d, 'adapter')} (PEFT format, with the tokenizer: "
          f"AutoPeftModelForCausalLM.from_pretrained(DIR) loads it)")
    print(f"checkpoint: {os.path.join(d, CKPT)}; losses: {os.path.join(d, 'losses.csv')}; all figures: {os.path.join(d, 'summary.json')}")
