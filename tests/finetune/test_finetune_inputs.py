"""The fine-tuning CLI's handling of its inputs, in process (no launch; a few seconds in all):
option values that start with '-', sizes in decimal units, the default dtype of a model
directory, options a run ignores ([Note: options a run ignores] in python_api/finetune/option_checks.py),
and the report's warning for a loss gap to the baseline beyond rounding ([Note: the loss gap to
the baseline] in python_api/finetune/report.py).
"""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

from tests.finetune.test_finetune import DIMS, TINY, _prepare

# ------------------------------------------------------------------------------- option values


@pytest.mark.parametrize("argv,message", [
    (["--memory-cap", "-5GB"], "argument --memory-cap: a size must be >= 0, got '-5GB'"),
    (["--pool-budget", "-64MiB"], "argument --pool-budget: a size must be >= 0, got '-64MiB'"),
    (["--memory-cap-ch", "-3:1GiB"], "argument --memory-cap-change: the step must be in [1, 2147483647], got -3"),
    (["--lr", "-1e-3"], "argument --lr: expected a finite positive number, got '-1e-3'"),
    (["--host-budget", "-1"], "argument --host-budget: a size must be >= 0, got '-1'"),
])
def test_values_starting_with_a_dash_are_named(argv, message, capsys):
    """argparse takes '-5GB' for an option and says "expected one argument"; the option's own
    check must see the value and name it."""
    from elastic_kernels.api.finetune import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"elastic-finetune: error: {message}" in err, err


def test_a_missing_value_is_still_reported(capsys):
    from elastic_kernels.api.finetune import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--steps", "--lr", "1"])
    assert "argument --steps: expected one argument" in capsys.readouterr().err
    assert parse_args(["--model", "-odd-name"]).model == "-odd-name"  # a value that is no option: taken as the value


def test_decimal_and_binary_sizes():
    from elastic_kernels.api.finetune.option_values import _size

    assert _size("40GB") == 40 * 10**9 and _size("40GiB") == 40 << 30 and _size("40G") == 40 << 30
    assert _size("512MB") == 512 * 10**6 and _size("1TiB") == 1 << 40 and _size("2k") == 2048


# ------------------------------------------------------------------------------- the model's dtype


@pytest.mark.parametrize("saved", [torch.bfloat16, torch.float16, torch.float32])
def test_model_dir_defaults_to_the_checkpoints_dtype(tmp_path, saved):
    """`--model DIR` without --dtype trains in the checkpoint's dtype (it trained a bf16
    checkpoint in float32: twice the memory, other numerics); --dtype still overrides it; the
    embedded model stays float32."""
    from elastic_kernels.api.finetune import embedded_config, embedded_model

    mdir = str(tmp_path / "model")
    embedded_model(embedded_config(**DIMS), seed=3, dtype=saved).save_pretrained(mdir)
    name = str(saved).replace("torch.", "")
    job = _prepare(TINY[12:] + ["--model", mdir, "--save-dir", str(tmp_path / "o")])
    assert job.spec.dtype == saved and job.args.dtype == name and job.config["model"]["dtype"] == name
    job = _prepare(TINY[12:] + ["--model", mdir, "--dtype", "float32", "--save-dir", str(tmp_path / "o")])
    assert job.spec.dtype == torch.float32
    job = _prepare(TINY + ["--save-dir", str(tmp_path / "o")])
    assert job.spec.dtype == torch.float32 and job.config["model"]["dtype"] == "float32"


# ------------------------------------------------------------------------------- ignored options


def _notices(argv, world_size=2, tmp="/nonexistent-elastic-out"):
    return _prepare(TINY + argv + ["--save-dir", tmp], world_size=world_size).notices


def test_ignored_options_are_named(tmp_path):
    out = str(tmp_path / "o")
    assert _notices([], tmp=out) == []
    [n] = _notices(["--host-budget", "64MiB"], tmp=out)
    assert n.startswith("--host-budget 64MiB is ignored") and "--offload-activations" in n
    assert _notices(["--host-budget", "64MiB", "--offload-activations"], tmp=out) == []
    [n] = _notices(["--steps", "4", "--plan", "auto", "--memory-cap-change", "9:1GiB", "--memory-cap-change", "2:1GiB"],
                   tmp=out)
    assert n == "--memory-cap-change at step 9 is ignored: after the last step (--steps 4)"
    [n] = _notices(["--memory-cap", "1GiB"], tmp=out)
    assert n.startswith("--memory-cap is ignored: only a planned run")
    [n] = _notices(["--plan", "auto", "--pool-budget", "0", "--keep-ratio", "0.5", "--persist-ratio", "0"], tmp=out)
    assert "so --pool-budget, --keep-ratio, --persist-ratio are not used by it" in n
    assert _notices(["--plan", "auto", "--pool-budget", "all"], tmp=out) != []  # given explicitly, even at its default
    [n] = _notices(["--weights-on", "host", "--compare-host"], tmp=out)
    assert n.startswith("--compare-host is ignored") and "same run twice" in n
    [n] = _notices(["--host-fraction", "0.5"], world_size=1, tmp=out)
    assert n.startswith("--host-fraction 0.5 is ignored on one rank")
    assert _notices(["--host-fraction", "0.5"], world_size=2, tmp=out) == []


def test_ignored_options_change_nothing_they_should_not(tmp_path):
    """--weights-on host --compare-host trains the main run once (no duplicate comparison); one
    rank with --host-fraction builds no host store and is not labelled as taking from it."""
    from elastic_kernels.api.finetune.policy import policy_of
    from elastic_kernels.api.finetune.runner import comparison_builds

    job = _prepare(TINY + ["--weights-on", "host", "--compare-host", "--baseline", "fsdp2", "--save-dir",
                           str(tmp_path / "o")])
    assert [what for what, _ in comparison_builds(job, None)] == ["fsdp2"]
    job = _prepare(TINY + ["--compare-host", "--save-dir", str(tmp_path / "o")])
    assert [what for what, _ in comparison_builds(job, None)] == ["weights on host"]
    job = _prepare(TINY + ["--host-fraction", "0.5", "--save-dir", str(tmp_path / "o")], world_size=1)
    one = policy_of(job.args, None, world_size=1)
    assert one.source_fraction == 0 and not one.uses_host_store
    two = policy_of(job.args, None, world_size=2)
    assert two.source_fraction == 0.5 and two.uses_host_store


# ------------------------------------------------------------------------------- the loss gap


def _fake_job(tmp_path, dtype="float32", dropout=0.0):
    from elastic_kernels.api.finetune import parse_args
    from elastic_kernels.api.finetune.configuration import FinetuneConfig

    args = parse_args(TINY + ["--save-dir", str(tmp_path)])
    args.dtype, args.lora_dropout, args._argv = dtype, dropout, ["--fake"]
    spec = SimpleNamespace(description=lambda: "tiny", embedded=True, tokenizer=SimpleNamespace(name="byte-level"))
    return SimpleNamespace(cfg=FinetuneConfig.from_args(args), notices=["an ignored option"], device=torch.device("cpu"), world_size=2,
                           spec=spec, data_info={"source": "x", "tokens": 1}, config={}, save_dir=str(tmp_path),
                           resume=None, run_id="0" * 32, samples=None)


def _runs(gap: float):
    base = [5.5, 5.2, 5.0, 4.9]
    def run(kind, name, losses):
        return {"kind": kind, "name": name, "status": "complete", "losses": losses, "steps_run": 4,
                "tokens_per_s": 100.0, "peak_memory_bytes": 1, "allgather_bytes_steady": 0.0,
                "allgather_bytes_first_step": 0, "h2d_bytes_steady": 0.0, "final_loss": losses[-1], "heldout_loss": 5.0}
    return [run("elastic", "elastic, budget all", [x + gap for x in base]), run("fsdp2", "FSDP2", base)]


def test_a_loss_gap_beyond_rounding_is_a_warning(tmp_path, monkeypatch, capsys):
    """A loss gap to FSDP2 beyond the dtype's rounding (the tied-head case gave 0.197, reported
    as a plain number) is a warning on stdout, in results.md and in summary.json; one within it
    is not; with LoRA dropout the runs are not compared."""
    import torch.distributed as dist

    from elastic_kernels.api.finetune import report, runner

    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(report, "plot", lambda runs, path, caption: open(path, "wb").close())
    job = _fake_job(tmp_path)
    bound = report.loss_gap_bound("float32", [5.5])
    assert 1e-5 < bound < 2e-5  # ~20 fp32 ulps at 5.5: the suite's tolerance
    assert 0.1 > report.loss_gap_bound("bfloat16", [5.5]) > 100 * 1.45e-4  # measured bf16 gap: 1.45e-4 (8 steps)

    summary = runner._summary(job, _runs(0.197))
    assert summary["status"] == "complete" and summary["warnings"][0] == "an ignored option"
    [w] = summary["warnings"][1:]
    assert w.startswith("elastic, budget all: max |loss - FSDP2 loss| = 0.197 over 4 steps, beyond what float32")
    runs = _runs(0.197)
    summary = runner._summary(job, runs)
    runner._write_report(job, runs, summary)
    out = capsys.readouterr().out
    assert f"WARNING: {w}" in out
    with open(os.path.join(tmp_path, "results.md")) as f:
        assert f"**Warning**: {w}" in f.read()
    with open(os.path.join(tmp_path, "summary.json")) as f:
        saved = json.load(f)
    assert w in saved["warnings"] and saved["runs"][0]["loss_gap_vs_fsdp2"] == "beyond rounding"

    summary = runner._summary(job, _runs(3e-7))
    assert summary["warnings"] == ["an ignored option"] and summary["runs"][0]["loss_gap_vs_fsdp2"] == "within rounding"
    job = _fake_job(tmp_path, dropout=0.1)
    summary = runner._summary(job, _runs(0.197))
    assert summary["warnings"] == ["an ignored option"]
    assert summary["runs"][0]["loss_gap_vs_fsdp2"].startswith("not compared")


# ------------------------------------------------------------- pipelines the options describe
# [Note: the pipelines the options describe, checked in prepare] in python_api/finetune/pipeline_layout.py

def test_a_pack_size_that_does_not_fit_says_what_runs(tmp_path):
    """--pp 2 --pack-size 3 on 4 layers runs packs of 2: said, with the packs that run."""
    four = ["--num-layers", "4", "--save-dir", str(tmp_path / "o")]
    [n] = _prepare(TINY + four + ["--pp", "2", "--pack-size", "3"]).notices
    assert n == ("--pack-size 3 with --pp 2: the 4 decoder layers run as 2 packs of 2/2 layers (a pack holds at most "
                 "--pack-size layers; the layers are balanced over ceil(layers / --pack-size) packs)")
    assert _prepare(TINY + four + ["--pp", "2", "--pack-size", "2"]).notices == []
    [n] = _prepare(TINY + four + ["--compare-pp", "2", "--pack-size", "3"]).notices
    assert n.startswith("--pack-size 3 with --compare-pp 2: the 4 decoder layers run as 2 packs of 2/2 layers")


def test_compare_pp_is_named_in_its_errors(tmp_path):
    from elastic_kernels.api.finetune import FinetuneError

    with pytest.raises(FinetuneError, match=r"^--compare-pp 3: the pipeline degree 3 does not divide the world size 2"):
        _prepare(TINY + ["--compare-pp", "3", "--save-dir", str(tmp_path / "o")])
    with pytest.raises(FinetuneError, match=r"^--pp 3: the pipeline degree 3 does not divide the world size 2"):
        _prepare(TINY + ["--pp", "3", "--save-dir", str(tmp_path / "o")])


def test_compare_pp_of_the_main_degree_is_not_trained_again(tmp_path):
    from elastic_kernels.api.finetune.runner import comparison_builds

    job = _prepare(TINY + ["--pp", "2", "--compare-pp", "2", "--save-dir", str(tmp_path / "o")])
    [n] = job.notices
    assert n.startswith("--compare-pp 2 is ignored: the main run is already --pp 2") and "same run twice" in n
    assert comparison_builds(job, None) == []
    job = _prepare(TINY + ["--compare-pp", "2", "--save-dir", str(tmp_path / "o")])
    assert job.notices == [] and [what for what, _ in comparison_builds(job, None)] == ["pipelined, pp 2"]


# ------------------------------------------------- a config that claims quantized weights
# [Note: a config that claims quantized weights] in python_api/finetune/models.py

def test_a_quantization_config_over_full_precision_files_is_refused_as_load_elastic_does(tmp_path):
    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.finetune import FinetuneError, embedded_config, embedded_model
    from elastic_kernels.api.loading import LoadError
    from elastic_kernels.api.nn import LoRAConfig

    d = str(tmp_path / "m")  # rows of 64 and 128: nf4's block of 64 fits them
    embedded_model(embedded_config(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2),
                   seed=3).save_pretrained(d)
    cfg = json.loads(open(os.path.join(d, "config.json")).read())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    claim = (r"the config says the checkpoint is saved quantized \(bitsandbytes 4-bit nf4, blocksize 64, double "
             r"quantization True\), but no tensor of its files is packed")
    with pytest.raises(LoadError, match=claim):
        load_elastic(d, LoRAConfig(r=4, alpha=8), ElasticPolicy(weight_format="nf4", quant_nested=True))
    for fmt in ("none", "nf4"):
        with pytest.raises(FinetuneError, match=rf"^model directory {d}: {claim}.*remove quantization_config"):
            _prepare(["--model", d, "--seq-len", "16", "--weight-format", fmt, "--save-dir", str(tmp_path / "o")])
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(FinetuneError, match=r"saved quantized by 'gptq'"):
        _prepare(["--model", d, "--seq-len", "16", "--save-dir", str(tmp_path / "o")])


# ------------------------------------------------- a comparison budget that repeats a run

def test_a_compared_budget_that_repeats_a_run_is_refused(capsys):
    """--compare-budgets trains each budget from scratch beside the main run: a budget given
    twice (0 and 0B are one budget) or equal to the main run's (--pool-budget, all when not
    given) would train the same run again, and is an option error naming it."""
    from elastic_kernels.api.finetune import parse_args

    for argv, said in ((["--compare-budgets", "0,0B"], r"budget\(s\) \['0'\] given twice"),
                       (["--compare-budgets", "50%,50.0%"], r"budget\(s\) \['50%'\] given twice"),
                       (["--compare-budgets", "0,all"], r"all is the main run's budget \(--pool-budget all"),
                       (["--pool-budget", "64MiB", "--compare-budgets", "67108864"], r"64 ?MiB is the main run's budget")):
        with pytest.raises(SystemExit) as info:
            parse_args(["--model", "tiny"] + argv)
        assert info.value.code == 2, argv
        assert re.search(said, capsys.readouterr().err), argv
    assert parse_args(["--model", "tiny", "--pool-budget", "0", "--compare-budgets", "50%,all"]).compare_budgets == [
        ("fraction", 0.5), None]


def test_the_seed_changes_the_batches():
    """--seed reaches the batches: torch's CPU generator keeps only the low 32 bits of a seed,
    and the former (seed << 32) | step lost the seed there (every seed drew seed 0's batches).
    Seed 0 keeps its batches (its generator of step s is seeded with s)."""
    from elastic_kernels.api.finetune.data import TokenWindows, _step_seed

    windows = TokenWindows(torch.arange(100_000), seq_len=16, probe_seqs=2, source="arange")
    starts = {seed: [windows.global_starts(seed, step, 8).tolist() for step in range(4)] for seed in (0, 1, 2, 3)}
    assert len({str(s) for s in starts.values()}) == 4, starts  # every seed its own batches
    assert starts[1] == [windows.global_starts(1, step, 8).tolist() for step in range(4)]  # and the same again
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        assert starts[0][step] == torch.randint(0, windows.n_train - 15, (8,), generator=gen).tolist()
    # a step's seed differs from every other step's of any seed within 1000 of it, for the
    # first 10,000 steps
    seen = {}
    for seed in range(0, 1001, 250):
        for step in range(10_000):
            key = _step_seed(seed, step)
            assert key not in seen, (seed, step, seen.get(key))
            seen[key] = (seed, step)
