"""The elastic-finetune CLI on a bitsandbytes 4-bit checkpoint (what transformers writes with
`BitsAndBytesConfig(load_in_4bit=True)`): accepted as load_elastic accepts it, its format named
in the header, its compute dtype used, and every option that would need full-precision weights
refused by name ([Note: the CLI reads bitsandbytes 4-bit checkpoints] in
python_api/finetune/models.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

ARGS = ["--seq-len", "16", "--micro-batch", "2", "--chunk-kib", "1", "--lora-r", "4", "--lora-alpha", "8",
        "--lr", "1e-2", "--no-progress"]


@pytest.fixture(scope="module")
def bnb_dir(tmp_path_factory):
    """transformers' own 4-bit nf4 checkpoint (double quantization, compute dtype bf16) of a
    small embedded-config model whose rows are multiples of the 64-weight block."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from elastic_kernels.api.finetune import embedded_config, embedded_model

    root = tmp_path_factory.mktemp("cli_bnb")
    cfg = embedded_config(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    embedded_model(cfg, seed=3).save_pretrained(str(root / "fp"))
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    out = str(root / "nf4")
    AutoModelForCausalLM.from_pretrained(str(root / "fp"), quantization_config=q, dtype=torch.float32,
                                         device_map="cpu").save_pretrained(out)
    return out


def _prepare(argv):
    from elastic_kernels.api.finetune import parse_args, prepare

    return prepare(parse_args(argv), 0, 2, 0)


def test_cli_accepts_a_bitsandbytes_checkpoint_and_names_its_format(bnb_dir, tmp_path):
    job = _prepare(["--model", bnb_dir, "--weight-format", "nf4", "--quant-nested", "--save-dir", str(tmp_path)] + ARGS)
    assert job.spec.packed is not None and job.args.dtype == "bfloat16"  # its bnb_4bit_compute_dtype
    desc = job.spec.description()
    assert "bfloat16, bitsandbytes 4-bit nf4, blocksize 64, double quantization True checkpoint" in desc, desc
    assert not hasattr(job.spec.config, "quantization_config")


@pytest.mark.parametrize("extra,match", [
    ([], r"is a bitsandbytes 4-bit nf4.*checkpoint, trained from its packed weights as they are: pass "
         r"--weight-format nf4 --quant-nested \(not --weight-format none\)"),
    (["--weight-format", "nf4"], r"pass --weight-format nf4 --quant-nested \(not --weight-format nf4\)"),
    (["--weight-format", "int8", "--quant-block", "64"], r"pass --weight-format nf4 --quant-nested"),
    (["--weight-format", "nf4", "--quant-nested", "--baseline", "fsdp2"], r"--baseline fsdp2 builds the model from "
                                                                          r"full-precision weights"),
    (["--weight-format", "nf4", "--quant-nested", "--compare-format", "none"], r"--compare-format none would need"),
    (["--weight-format", "nf4", "--quant-nested", "--weights-on", "host"], r"the host tier"),
])
def test_cli_refuses_what_needs_full_precision(bnb_dir, tmp_path, extra, match):
    from elastic_kernels.api.finetune.errors import FinetuneError

    with pytest.raises(FinetuneError, match=match):
        _prepare(["--model", bnb_dir, "--save-dir", str(tmp_path)] + ARGS + extra)


def test_cli_trains_from_a_bitsandbytes_checkpoint(bnb_dir, tmp_path):
    from tests.finetune.test_finetune import summary_of, torchrun

    d = str(tmp_path / "run")
    _, out, err = torchrun(["--model", bnb_dir, "--weight-format", "nf4", "--quant-nested", "--steps", "2",
                            "--save-dir", d] + ARGS, what="--model <bitsandbytes checkpoint>")
    assert "bitsandbytes 4-bit nf4" in out + err
    (run,) = summary_of(d)["runs"]
    assert run["status"] == "complete" and len(run["losses"]) == 2, run
    assert all(x == x and x < 10 for x in run["losses"]), run["losses"]
