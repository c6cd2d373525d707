"""--model resolution, the tokenizer refusal and the learning-rate defaults of the CLI
([Note: what --model names], [Note: the tokenizer is never silently replaced] in
python_api/finetune/models.py; [Note: learning-rate defaults] in policy.py). Every case runs
prepare() only (no process group, no step) on tiny configurations, but for the two that use the
real model (the `real_model` fixture fetches it into the cache where it is absent)."""

from __future__ import annotations

import math
import os

import pytest

from tests.finetune.test_finetune import DIMS


def _prepare(argv, tmp_path):
    from elastic_kernels.api.finetune import parse_args, prepare

    return prepare(parse_args(argv + ["--save-dir", str(tmp_path / "out"), "--overwrite"]), 0, 1, 0)


def _model_dir(path, vocab):
    from elastic_kernels.api.finetune import embedded_config, embedded_model

    cfg = embedded_config(**DIMS)
    cfg.vocab_size = vocab
    embedded_model(cfg, seed=3).save_pretrained(path)
    return str(path)


def _tokenizer_dir(path, size):
    """A word-level tokenizer of `size` ids (the eos among them) saved as a HF tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return str(path)


def test_a_large_vocabulary_without_tokenizer_is_refused_naming_the_fix(tmp_path):
    """Issue 31 item 1: weights and config only, vocabulary > 257: refused (it used to train on
    bytes and exit 0); the message names --tokenizer DIR and --tokenizer bytes."""
    from elastic_kernels.api.finetune import FinetuneError

    mdir = _model_dir(tmp_path / "m", vocab=300)
    with pytest.raises(FinetuneError, match=r"no tokenizer files .*vocabulary of 300 ids.*--tokenizer DIR.*"
                                            r"--tokenizer bytes"):
        _prepare(["--model", mdir], tmp_path)
    # The fixes: a tokenizer folder (its name in the header), or bytes by name (said as a warning).
    job = _prepare(["--model", mdir, "--tokenizer", _tokenizer_dir(tmp_path / "tok", 300), "--data",
                    _words(tmp_path)], tmp_path)
    assert "tok" in job.spec.tokenizer.name and job.spec.tokenizer.vocab_size == 300
    job = _prepare(["--model", mdir, "--tokenizer", "bytes"], tmp_path)
    assert job.spec.tokenizer.name == "byte-level"
    assert any("--tokenizer bytes" in n and "300 ids" in n for n in job.notices), job.notices
    # A tokenizer larger than the model's vocabulary is not its tokenizer.
    with pytest.raises(FinetuneError, match="vocabulary has 400 ids, more than the model's 300"):
        _prepare(["--model", mdir, "--tokenizer", _tokenizer_dir(tmp_path / "big", 400)], tmp_path)
    with pytest.raises(FinetuneError, match="--tokenizer .*nowhere: not a directory"):
        _prepare(["--model", mdir, "--tokenizer", str(tmp_path / "nowhere")], tmp_path)
    # The byte vocabulary itself (257: bytes + end of document) still needs no tokenizer files.
    job = _prepare(["--model", _model_dir(tmp_path / "m257", vocab=257)], tmp_path)
    assert job.spec.tokenizer.name == "byte-level" and not job.notices


def _words(tmp_path):
    p = tmp_path / "words.txt"
    p.write_text(" ".join(f"w{i % 298 + 2}" for i in range(1000)))
    return str(p)


def test_model_names_and_their_errors(tmp_path, monkeypatch):
    """tiny is the random model; a path that is neither a directory nor a .gguf, an unknown name
    and an unreachable hub id are errors naming what was tried; size options need --model tiny."""
    from elastic_kernels.api.finetune import FinetuneError

    job = _prepare(["--model", "tiny", "--hidden-size", "32", "--num-heads", "4", "--num-kv-heads", "2"], tmp_path)
    assert job.spec.embedded and job.spec.config.hidden_size == 32 and job.spec.name is None
    with pytest.raises(FinetuneError, match="--hidden-size size the tiny random model: add --model tiny"):
        _prepare(["--hidden-size", "32"], tmp_path)
    with pytest.raises(FinetuneError, match="--model no-such-model: no such directory or file, and not a hub id"):
        _prepare(["--model", "no-such-model"], tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FinetuneError, match="is not a directory or a .gguf file"):
        _prepare(["--model", str(tmp_path / "weights.bin")], tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FinetuneError, match=r"--model nobody/nothing: cannot find this hub model: HF_HUB_OFFLINE is "
                                            r"set, so the hub was not asked; the local hub cache .* has no snapshot"):
        _prepare(["--model", "nobody/nothing"], tmp_path)


def test_a_hub_snapshot_in_the_local_cache_is_used_offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE: the hub's local cache is read (local_files_only), and the adapter's base is
    the hub id, not the snapshot's folder."""
    import huggingface_hub

    mdir = _model_dir(tmp_path / "m", vocab=257)
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, local_files_only))
        return mdir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    job = _prepare(["--model", "someone/tiny-llama"], tmp_path)
    assert calls == [("someone/tiny-llama", True)]
    assert job.spec.name == "someone/tiny-llama" and job.spec.source == mdir


def test_learning_rate_defaults(tmp_path):
    """Pretrained: 2e-4, warm-up a tenth of the steps, cosine to 0; tiny: 2e-3 constant; the
    schedule's values against the closed form."""
    from elastic_kernels.api.finetune.options import parse_args
    from elastic_kernels.api.finetune.policy import lr_at, resolve_training_defaults

    args = parse_args(["--steps", "20"])
    resolve_training_defaults(args, pretrained=True)
    assert (args.lr, args.lr_schedule, args.warmup_steps) == (2e-4, "cosine", 2)
    assert lr_at(args, 0) == pytest.approx(1e-4) and lr_at(args, 1) == pytest.approx(2e-4)
    assert lr_at(args, 2) == pytest.approx(2e-4)  # the peak, then cosine over steps 2..19 of 18
    assert lr_at(args, 11) == pytest.approx(2e-4 * 0.5 * (1 + math.cos(math.pi * 9 / 18)))
    assert lr_at(args, 19) < 2e-6
    args = parse_args(["--steps", "20", "--lr-schedule", "linear", "--warmup-steps", "0", "--lr", "1e-3"])
    resolve_training_defaults(args, pretrained=True)
    assert lr_at(args, 0) == pytest.approx(1e-3) and lr_at(args, 10) == pytest.approx(5e-4)
    args = parse_args(["--steps", "20"])
    resolve_training_defaults(args, pretrained=False)
    assert (args.lr, args.lr_schedule, args.warmup_steps) == (2e-3, "constant", 0)
    assert {lr_at(args, s) for s in range(20)} == {2e-3}


def test_the_default_model_is_the_real_one(tmp_path, real_model):
    from elastic_kernels.api.loading.pretrained import pretrained_dir

    job = _prepare(["--steps", "2"], tmp_path)
    assert job.args.model == "smollm2-135m-instruct"
    assert job.spec.source == str(pretrained_dir("smollm2-135m-instruct")) == job.spec.name
    assert job.spec.config.num_hidden_layers == 30 and job.spec.config.vocab_size == 49152
    assert "from " + job.spec.source in job.spec.tokenizer.name


@pytest.mark.distributed
def test_real_model_adapter_loads_with_autopeft(tmp_path, real_model):
    """The CLI on its default model and data (2 gloo ranks, 1 step): the adapter folder loads with
    AutoPeftModelForCausalLM alone (task type, base path and tokenizer in it), and the reloaded
    model's logits on the held-out rows equal the elastic model's (fp32: the elastic layers sum
    in another order than the dense ones; 1e-4 is 100x the largest difference seen)."""
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from elastic_kernels.api.loading.pretrained import pretrained_dir
    from tests.finetune.test_finetune import summary_of, torchrun

    out = str(tmp_path / "out")
    _, stdout, _ = torchrun(["--steps", "1", "--micro-batch", "1", "--grad-accum", "1", "--lora-targets", "q_proj,v_proj",
                             "--save-probe", "--sample-tokens", "8", "--no-progress", "--save-dir", out],
                            what="the real model's CLI run")
    assert "tokenizer TokenizersBackend from" in stdout and "sample (8 greedy tokens)" in stdout
    adapter = os.path.join(out, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        cfg = __import__("json").load(f)
    assert cfg["task_type"] == "CAUSAL_LM"
    assert cfg["base_model_name_or_path"] == str(pretrained_dir("smollm2-135m-instruct"))
    model = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    AutoTokenizer.from_pretrained(adapter)  # the tokenizer is beside the adapter
    probe = load_file(os.path.join(out, "probe.safetensors"))
    inputs = {k: v for k, v in probe.items() if k in ("input_ids", "position_ids")}
    import torch

    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    s = summary_of(out)
    assert s["heldout"]["heldout_loss_before"] > 0 and len(s["heldout"]["samples"]) == 2
    assert abs(s["heldout"]["heldout_loss_reloaded"] - s["runs"][0]["heldout_loss"]) < 1e-4
