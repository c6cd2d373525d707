"""Profiling identical layers once against profiling every layer, on a planned CLI run.

    python bench/bench_profile_reuse.py [--rounds 2] [--steps 3] [CLI options ...]

Runs the fine-tuning CLI in this process (`--plan auto`; default options below: the real model,
SmolLM2-135M-Instruct, 4 GiB cap, micro-batch 4 x 128 tokens) with its `measure_profile`
wrapped: the first (and only) profiling call profiles the model `--rounds` times each way,
interleaved (round k: reuse then all layers, round k+1 reversed), timing each whole call and
its phases (the steps, the backward-window peaks, the timed steps, the links, the dequant),
and hands the last reuse profile to the CLI, which plans and runs `--steps` steps under that
plan. Printed, from one process:
- per call: the profiling seconds and its phases, the number of layers profiled;
- per decoder layer, the reuse profile against the all-layers profile of the same round and,
  for scale, the all-layers profile of another round against it: forward and backward time
  at the profiled micro-batch (relative error, median and max over layers), activation and
  input bytes (exact equality);
- the plans each profile gives at the CLI's cap and at 1.0 / 1.1 / 1.3 x the all-layers
  profile's least memory: the same choices or not, and each plan's predicted step time;
- the CLI's plan: predicted step time against the measured step times of its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CLI = ["--plan", "auto", "--memory-cap", "4GiB", "--seq-len", "128", "--micro-batch", "4", "--no-progress",
               "--overwrite"]
PHASES = ("_run_step", "_window_peaks", "_timings", "_link_measurements", "_dequant_times")


def _choices(plan) -> tuple:
    return (plan.micro_batch, plan.accumulation, plan.prefetch_depth, plan.host_fraction, plan.offload_activations,
            tuple((lp.recompute, tuple((w.keep_chunks, w.persist_chunks) for w in lp.weights)) for lp in plan.layers))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b if b else (0.0 if a == 0 else float("inf"))


def compare_layers(p, ref, tokens: int) -> dict:
    errs = {"fwd": [], "bwd": []}
    bytes_equal = True
    for a, b in zip(p.layers, ref.layers):
        assert a.name == b.name, (a.name, b.name)
        if not a.name.startswith("weight:"):
            errs["fwd"].append(_rel(a.fwd_s(tokens), b.fwd_s(tokens)))
            errs["bwd"].append(_rel(a.bwd_s(tokens), b.bwd_s(tokens)))
        bytes_equal &= (a.act_bytes_per_token, a.input_bytes_per_token, a.weights) == \
            (b.act_bytes_per_token, b.input_bytes_per_token, b.weights)
    out = {k: (statistics.median(v), max(v)) for k, v in errs.items()}
    whole = lambda q: sum(x.fwd_s(tokens) + x.bwd_s(tokens) for x in q.layers)  # noqa: E731
    out["layers_total"] = _rel(whole(p), whole(ref))
    out["bytes_equal"] = bytes_equal and p.static_bytes == ref.static_bytes and \
        p.adapter_grad_bytes == ref.adapter_grad_bytes
    out["workspace"] = (p.outside.workspace_bytes_per_token, ref.outside.workspace_bytes_per_token,
                        p.outside.recompute_workspace_bytes_per_token, ref.outside.recompute_workspace_bytes_per_token)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save-dir", default="/tmp/bench_profile_reuse")
    ap.add_argument("--model", default=None, help="the CLI's --model (default: the cached smollm2-135m-instruct)")
    known, rest = ap.parse_known_args()
    import elastic_kernels.api.finetune.planning as cli_planning
    import elastic_kernels.api.planning.measure as measure
    from elastic_kernels.api.finetune.cli import main as cli_main
    from elastic_kernels.api.loading.pretrained import pretrained_dir
    from elastic_kernels.api.planner.search import least_memory, plan_from_profile

    model_arg = known.model or str(pretrained_dir("smollm2-135m-instruct"))
    phase_s: dict[str, float] = {}
    for name in PHASES:
        fn = getattr(measure, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                phase_s[_name] = phase_s.get(_name, 0.0) + time.perf_counter() - t0
        setattr(measure, name, timed)

    calls: list[dict] = []
    original = cli_planning.measure_profile

    def wrapped(model, batches, report=None, **kwargs):
        for r in range(known.rounds):
            for all_layers in ((False, True) if r % 2 == 0 else (True, False)):
                phase_s.clear()
                mine: dict = {}
                t0 = time.perf_counter()
                profile = original(model, batches, all_layers=all_layers, report=mine, **kwargs)
                seconds = time.perf_counter() - t0
                calls.append({"round": r, "all_layers": all_layers, "seconds": seconds, "phases": dict(phase_s),
                              "profiled": len(mine["profiled_units"]), "profile": profile,
                              "tokens": mine["tokens"], "load": os.getloadavg()[0], "report": mine})
                print(f"round {r} {'all layers' if all_layers else 'reuse     '}: {seconds:.1f} s, "
                      f"{len(mine['profiled_units'])} units profiled, load {os.getloadavg()[0]:.1f}; phases "
                      + ", ".join(f"{k.strip('_')} {v:.1f}" for k, v in phase_s.items()), flush=True)
        last = [c for c in calls if not c["all_layers"]][-1]
        if report is not None:
            report.update(last["report"])
        return last["profile"]

    cli_planning.measure_profile = wrapped
    sys.argv = ["elastic-finetune", "--model", model_arg, "--steps", str(known.steps), "--save-dir",
                known.save_dir] + DEFAULT_CLI + rest
    code = cli_main()
    if code:
        raise SystemExit(code)
    with open(os.path.join(known.save_dir, "profiles.json"), "w") as f:
        json.dump([{k: (v.to_dict() if k == "profile" else v) for k, v in c.items() if k != "report"} for c in calls],
                  f)

    reuse = [c for c in calls if not c["all_layers"]]
    whole = [c for c in calls if c["all_layers"]]
    tokens = calls[0]["tokens"]
    print("\nprofiling seconds: reuse " + ", ".join(f"{c['seconds']:.1f}" for c in reuse)
          + "; all layers " + ", ".join(f"{c['seconds']:.1f}" for c in whole))
    ratios = [w["seconds"] / u["seconds"] for u, w in zip(reuse, whole)]
    print("per-round ratio all / reuse: " + ", ".join(f"{x:.2f}" for x in ratios)
          + f"; median {statistics.median(ratios):.2f}")
    for u, w in zip(reuse, whole):
        print(f"round {u['round']}: reuse vs all layers:", compare_layers(u["profile"], w["profile"], tokens))
    if len(whole) >= 2:
        print("all layers round 1 vs round 0 (noise):", compare_layers(whole[1]["profile"], whole[0]["profile"], tokens))
    plan_doc = json.load(open(os.path.join(known.save_dir, "plan.json")))
    gb = plan_doc["global_batch"]
    cap = plan_doc["memory_bytes"]
    for u, w in zip(reuse, whole):
        least_w = least_memory(w["profile"], gb)
        least_u = least_memory(u["profile"], gb)
        print(f"round {u['round']}: least memory all layers {least_w} B, reuse {least_u} B "
              f"({_rel(least_u, least_w):+.4%})")
        for label, m in (("cap", cap), ("1.0x least", least_w), ("1.1x least", int(1.1 * least_w)),
                         ("1.3x least", int(1.3 * least_w))):
            try:
                pu, pw = plan_from_profile(u["profile"], m, gb), plan_from_profile(w["profile"], m, gb)
            except Exception as exc:  # noqa: BLE001 - reported: one profile has no plan at this memory
                print(f"  {label} ({m} B): {type(exc).__name__}: {exc}")
                continue
            print(f"  {label} ({m} B): same plan {_choices(pu) == _choices(pw)}; micro-batch x accumulation "
                  f"{pu.micro_batch}x{pu.accumulation} / {pw.micro_batch}x{pw.accumulation}, recomputed "
                  f"{sum(lp.recompute for lp in pu.layers)} / {sum(lp.recompute for lp in pw.layers)}; predicted "
                  f"step {pu.predicted_step_time_s:.3f} / {pw.predicted_step_time_s:.3f} s")
    summary = json.load(open(os.path.join(known.save_dir, "summary.json")))
    run = summary["runs"][0] if "runs" in summary else summary
    print(f"\nCLI plan: predicted step {plan_doc['predicted_step_time_s']:.3f} s; measured step times "
          f"{[round(t, 3) for t in run.get('step_times_s', [])]} s")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as the CLI's entry: no interpreter teardown ([Note: exiting without teardown])
