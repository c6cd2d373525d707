"""--weight-format / --quant-block / --quant-nested of the elastic-finetune CLI: the policy it
builds, its refusals, the configuration ranks agree on and checkpoints carry, and a short run
on 2 gloo ranks under torchrun."""

from __future__ import annotations

import json
import os

import pytest

from elastic_kernels.api.finetune.options import parse_args, parse_config
from elastic_kernels.api.finetune.policy import policy_of

BASE = ["--model", "tiny", "--hidden-size", "64", "--intermediate-size", "128", "--num-layers", "2", "--num-heads", "4",
        "--num-kv-heads", "2", "--seq-len", "16", "--micro-batch", "2", "--chunk-kib", "1",
        "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-2", "--no-progress", "--sample-tokens", "0"]


def test_policy_follows_the_options():
    assert policy_of(parse_args(BASE), None).weight_format is None
    p = policy_of(parse_args(BASE + ["--weight-format", "nf4", "--quant-nested"]), None)
    assert (p.weight_format, p.block_size, p.quant_nested) == ("nf4", 64, True)
    p = policy_of(parse_args(BASE + ["--weight-format", "int8", "--quant-block", "64"]), None)
    assert (p.weight_format, p.block_size, p.quant_nested) == ("int8", 64, False)
    for pp in (["--pp", "2"], ["--compare-pp", "2"], ["--pp", "auto", "--plan", "auto"]):
        # pipelines quantize each pack's weights on build; the pipeline planner sizes them by format
        assert policy_of(parse_args(BASE + ["--weight-format", "nf4"] + pp), None).weight_format == "nf4"


@pytest.mark.parametrize("extra,match", [
    (["--weight-format", "fp8"], r"invalid choice: 'fp8'"),
    (["--quant-block", "64"], r"--quant-block / --quant-nested need --weight-format nf4 or int8"),
    (["--quant-nested"], r"need --weight-format"),
    (["--weight-format", "int8", "--quant-nested"], r"--quant-nested is an nf4 option"),
    (["--weight-format", "nf4", "--quant-block", "48"], r"power of two in \[32, 4096\], got 48"),
    (["--weight-format", "nf4", "--quant-block", "16"], r"--quant-block"),
])
def test_bad_options(extra, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra)
    assert __import__("re").search(match, capsys.readouterr().err), capsys.readouterr()


def test_run_configuration_carries_the_format():
    """Only when a format is set (checkpoints written before the option keep matching a
    --weight-format none run); a checkpoint in another format differs by that field."""
    from elastic_kernels.api.finetune.agreement import configuration_differences, run_configuration

    class _Spec:
        class config:
            @staticmethod
            def to_dict():
                return {"hidden_size": 64}
        embedded, seed, tokenizer = True, 0, type("T", (), {"fingerprint": "t"})()

    data = {"tokens": 1, "sha256": "x"}
    none = run_configuration(parse_config(BASE), _Spec, data, ["q_proj"], 2)
    nf4 = run_configuration(parse_config(BASE + ["--weight-format", "nf4"]), _Spec, data, ["q_proj"], 2)
    assert "weight_format" not in none["policy"]
    assert nf4["policy"]["weight_format"] == "nf4" and nf4["policy"]["quant_block_size"] is None
    diffs = configuration_differences(nf4, none)
    assert any(d.startswith("policy.weight_format: checkpoint has 'nf4'") for d in diffs), diffs


@pytest.mark.distributed
def test_short_run_on_two_ranks(tmp_path):
    from tests.finetune.test_finetune import summary_of, torchrun

    runs = {}
    for fmt in ("none", "nf4"):
        d = str(tmp_path / fmt)
        torchrun(BASE + ["--steps", "2", "--weight-format", fmt, "--save-dir", d, "--pool-budget", "0"],
                 what=f"--weight-format {fmt}")
        runs[fmt] = summary_of(d)
        with open(os.path.join(d, "checkpoint", "config.json")) as f:
            cfg = json.load(f)
        assert cfg["info"]["policy"]["weight_format"] == (None if fmt == "none" else fmt)
        if fmt == "nf4":
            assert cfg["run"]["policy"]["weight_format"] == "nf4"
    (fp,), (q,) = runs["none"]["runs"], runs["nf4"]["runs"]
    assert q["status"] == fp["status"] == "complete"
    # Every elastic weight is 64 or 128 wide, its 1 KiB chunks hold whole rows and 2 ranks
    # split each blob evenly: nf4 stores 4.5 of fp32's 32 bits per weight, in the shards and
    # in what the all-gathers move (counted by the runtime and, independently, at the
    # collective by the CLI's counting wrapper). Below a full cache a step also all-gathers the
    # updated fp32 adapters ([Note: sharded optimizer state]), the same bytes in both runs.
    assert q["frozen_bytes"] * 32 == fp["frozen_bytes"] * 4.5
    adapters = q["optimizer_allgather_bytes_per_step"]
    assert adapters == fp["optimizer_allgather_bytes_per_step"] and min(adapters) > 0
    frozen_q, frozen_fp = (r["allgather_bytes_first_step"] - adapters[0] for r in (q, fp))
    assert frozen_q * 32 == frozen_fp * 4.5 > 0
    assert q["allgather_bytes_counted_per_step"] == q["allgather_bytes_per_step"]
    assert q["losses"] != fp["losses"]  # another model: the base weights are the dequantized values


# ------------------------------------ every block fits every row (issue 28; issue 31 item 2 before it)
# [Note: a weight a format cannot store is an option error] in python_api/finetune/formats.py.

@pytest.mark.parametrize("extra", [
    ["--intermediate-size", "688", "--weight-format", "nf4"],  # rows of 688 = 16 x 43: no block divides them
    ["--hidden-size", "576", "--intermediate-size", "1536", "--num-heads", "9", "--num-kv-heads", "3",
     "--weight-format", "int8"],  # int8's 256 on rows of 576
    ["--weight-format", "nf4", "--quant-block", "4096"],
    ["--intermediate-size", "688", "--compare-format", "int8", "--quant-block", "128"],
], ids=["nf4-688", "int8-576", "nf4-4096", "compare-int8-688"])
def test_every_block_fits_every_row(extra, tmp_path):
    """The options the CLI refused before issue 28 (a block that does not divide a row) pass the
    check prepare() runs on every rank: blocks run over the flattened weight."""
    from elastic_kernels.api.finetune.formats import check_weight_formats
    from elastic_kernels.api.finetune.models import resolve_model

    cfg = parse_config(BASE + ["--save-dir", str(tmp_path / "out")] + extra)
    check_weight_formats(resolve_model(cfg), cfg)


def test_a_weight_a_format_cannot_store_names_the_option(tmp_path, monkeypatch):
    """What the policy still refuses (a weight that is not 2-D) is the CLI's error, naming the option."""
    import torch.nn as nn

    from elastic_kernels.api.finetune import FinetuneError, formats as fmts
    from elastic_kernels.api.finetune.models import resolve_model

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.proj.weight = nn.Parameter(self.proj.weight.detach().reshape(2, 2, 4))

    cfg = parse_config(BASE + ["--save-dir", str(tmp_path / "out"), "--weight-format", "nf4"])
    spec = resolve_model(cfg)

    class Spec:
        dtype = spec.dtype

        def meta_model(self):
            return Odd()

    monkeypatch.setattr(fmts, "elastic_weights", lambda meta, c, itemsize: ["proj"])
    with pytest.raises(FinetuneError, match=r"^--weight-format nf4: proj: weight_format='nf4' stores 2-D weights "
                                            r".* shape \(2, 2, 4\); run without --weight-format nf4$"):
        fmts.check_weight_formats(Spec(), cfg)

