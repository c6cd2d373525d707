"""The CLI's configuration as types (python_api/finetune/configuration.py): every option lands
in one group, the JSON record reads back to the same configuration, the option view is
read-only, and the resume comparison of the typed record refuses exactly what the run
configuration's comparison (agreement.run_configuration, what --resume compared before the
record existed) refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest

BASE = ["--model", "tiny", "--dtype", "float32", "--lr", "1e-3", "--lr-schedule", "constant", "--warmup-steps", "0",
        "--steps", "4"]


def _config(argv):
    from elastic_kernels.api.finetune.options import parse_config

    return parse_config(BASE + argv)


def test_every_option_has_one_field_and_every_field_an_option():
    from elastic_kernels.api.finetune.configuration import GROUPS
    from elastic_kernels.api.finetune.options import build_parser

    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    # check_options adds the lists it makes of --baseline and --compare-format
    derived = {"baselines", "compare_formats"}
    names = [f.name for _, cls in GROUPS for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))  # one group per option
    assert set(names) == dests | derived


def test_the_groups_hold_the_checked_values():
    c = _config(["--baseline", "fsdp2,ddp", "--compare-budgets", "0,50%", "--memory-cap-change", "3:1KiB", "--plan",
                 "auto", "--lora-targets", " q_proj , v_proj ", "--weight-format", "nf4", "--quant-nested"])
    assert c.peers.baselines == ("fsdp2", "ddp") and c.peers.baseline == "fsdp2,ddp"
    assert c.peers.compare_budgets == (0, ("fraction", 0.5))
    assert c.planner.memory_cap_change == ((3, 1024),)
    assert c.lora.lora_targets == "q_proj,v_proj"
    assert (c.weights.weight_format, c.weights.quant_nested) == ("nf4", True)
    assert {"baseline", "plan", "lora_targets"} <= c.given and "seq_len" not in c.given
    assert c.argv is not None and c.argv[:2] == ("--model", "tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.training.lr = 1.0


def test_the_json_record_reads_back():
    from elastic_kernels.api.finetune.configuration import FinetuneConfig

    c = _config(["--baseline", "fsdp2", "--compare-budgets", "0,50%", "--memory-cap-change", "3:1KiB", "--plan", "auto",
                 "--pool-budget", "25%", "--host-budget", "1MiB", "--fsdp2-reshard", "2"])
    record = json.loads(c.to_json())
    assert record["training"]["lr"] == 1e-3 and record["elastic"]["pool_budget"] == ["fraction", 0.25]
    back = FinetuneConfig.from_dict(record)
    assert back == dataclasses.replace(c, argv=None)  # the command line is the report's, not the record's
    from elastic_kernels.api.finetune import FinetuneError

    bad = json.loads(c.to_json())
    bad["lora"]["lora_rank"] = 4
    with pytest.raises(FinetuneError, match=r"lora has unknown fields \['lora_rank'\]"):
        FinetuneConfig.from_dict(bad)
    del bad["lora"]
    with pytest.raises(FinetuneError, match="group 'lora' missing"):
        FinetuneConfig.from_dict(bad)


def test_the_option_view_reads_by_name_and_is_read_only():
    c = _config(["--lora-r", "16", "--host-budget", "1MiB"])
    v = c.options()
    assert (v.lora_r, v.host_budget, v.steps, v.baselines) == (16, 2**20, 4, ())
    assert "lora_r" in v._given and v._argv[:2] == ["--model", "tiny"]
    assert getattr(v, "no_such_option", "absent") == "absent"
    with pytest.raises(AttributeError, match="frozen"):
        v.lora_r = 4


class _Spec:
    class config:
        @staticmethod
        def to_dict():
            return {"hidden_size": 64}

    embedded, seed, tokenizer = True, 0, type("T", (), {"fingerprint": "t"})()


# (saved run's options, this run's options, refused): each changes one option, or one combination
R, OK = True, False
CHANGES = [
    ([], ["--lr", "2e-3"], R),
    ([], ["--steps", "8"], OK),  # a constant rate: --steps may grow on resume
    (["--lr-schedule", "cosine"], ["--lr-schedule", "cosine", "--steps", "8"], R),  # the decay ends at --steps
    ([], ["--lr-schedule", "linear"], R),
    ([], ["--warmup-steps", "1"], R),
    ([], ["--weight-decay", "0.1"], R),
    ([], ["--seed", "1"], R),
    ([], ["--seq-len", "32"], R),
    ([], ["--micro-batch", "3"], R),
    ([], ["--grad-accum", "3"], R),
    ([], ["--lora-r", "4"], R),
    ([], ["--lora-alpha", "4"], R),
    ([], ["--lora-dropout", "0.1"], R),
    ([], ["--chunk-kib", "64"], R),
    ([], ["--dtype", "bfloat16"], R),
    ([], ["--keep-ratio", "0.5", "--persist-ratio", "0.5"], OK),  # residency: never a computed bit
    ([], ["--pool-budget", "0", "--prefetch-depth", "2", "--collective-kib", "64"], OK),
    ([], ["--weights-on", "host"], OK),
    ([], ["--save-every", "1", "--timeout-s", "10"], OK),
    ([], ["--weight-format", "nf4"], R),
    (["--weight-format", "nf4"], ["--weight-format", "nf4", "--quant-block", "128"], R),
    (["--weight-format", "nf4"], ["--weight-format", "nf4", "--quant-nested"], R),
    ([], ["--pp", "2"], R),
    (["--pp", "2"], ["--pp", "2", "--schedule", "gpipe"], R),
    (["--pp", "2"], ["--pp", "2", "--micro-batches", "4"], OK),  # 4 = --grad-accum x pp: the same micro-batches
    (["--pp", "2"], ["--pp", "2", "--micro-batches", "2"], R),
    (["--pp", "2"], ["--pp", "2", "--pack-window", "2", "--pack-residency", "phase"], OK),
    ([], ["--compare-pp", "2", "--schedule", "gpipe"], OK),  # the main run is not pipelined: not its schedule
]


@pytest.mark.parametrize("saved,current,refused", CHANGES, ids=[" ".join(c) for _, c, _ in CHANGES])
def test_the_typed_resume_comparison_refuses_what_the_run_configuration_refuses(saved, current, refused):
    """The reference: agreement.run_configuration's record compared as read_checkpoint compares
    it (agreement.configuration_differences); the typed record must differ exactly when it
    does, so recording it changes no resume that was allowed or refused."""
    from elastic_kernels.api.finetune.agreement import configuration_differences, run_configuration
    from elastic_kernels.api.finetune.configuration import resume_differences

    a, b = _config(saved), _config(current)
    data = {"tokens": 1, "sha256": "x"}
    run_a = run_configuration(a, _Spec, data, ["q_proj"], 2)
    run_b = run_configuration(b, _Spec, data, ["q_proj"], 2)
    typed = resume_differences(a, b)
    assert bool(configuration_differences(run_a, run_b)) == refused  # the reference refuses what the case says
    assert bool(typed) == refused, typed
    assert resume_differences(a, a) == []
