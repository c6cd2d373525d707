"""Full state dicts, save_pretrained, the HF Trainer and DDP on converted models (python_api/hf/).

Tolerances as in tests/nn/test_lora.py (rtol = atol = 1e-4 in fp32) where a plain HF model is
compared with the elastic one (chunked GEMMs differ in summation order); equality where the
same values must come back (state dicts, reloads into an elastic model with the same chunking).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests._dist import run_distributed
from tests.nn.test_lora import TOL, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ("q_proj", "v_proj", "down_proj")
# 5 rows per chunk of a 32-wide weight: divides no projection; lm_head elastic too.
POLICY = dict(chunk_bytes=32 * 4 * 5, replicate_below_bytes=0)


def _converted(seed=0, **policy):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    model = convert_to_elastic(tiny_llama(seed), LoRAConfig(r=4, alpha=8, target_modules=TARGETS),
                               ElasticPolicy(**{**POLICY, **policy}))
    gen = torch.Generator().manual_seed(7)  # B = 0 would hide the adapters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _ids():
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=_ids()).logits


# ---------------------------------------------------------------------------- state dict


def _state_dict_worker(rank, world_size):
    plain = tiny_llama()
    want_base = plain.state_dict()
    model = _converted()
    sd = model.state_dict()
    lora_keys = sorted(k for k in sd if ".lora_" in k)
    assert sorted(set(sd) - set(lora_keys)) == sorted(want_base), "the base keys are the plain model's"
    for k, v in want_base.items():
        assert torch.equal(sd[k], v), k
    assert list(sd).index("model.layers.0.self_attn.q_proj.weight") < list(sd).index(
        "model.layers.0.self_attn.q_proj.lora_A.weight")
    n_lora = sum(sd[k].numel() for k in lora_keys)
    assert model.num_parameters() == plain.num_parameters() + n_lora
    assert model.num_parameters(only_trainable=True) == n_lora
    assert model.num_parameters(exclude_embeddings=True) == plain.num_parameters(exclude_embeddings=True) + n_lora
    assert model.config.architectures is None or model.config.architectures == ["LlamaForCausalLM"]
    assert type(model).__name__ == "LlamaForCausalLM"
    want = _logits(model)

    # Into another elastic model (other weights, other adapters) whose pool already caches
    # the old chunks: every shard and every cached chunk must be replaced.
    other = _converted(seed=1)
    for _ in range(2):
        _logits(other)
    assert not torch.equal(_logits(other), want)
    result = other.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(other), want)
    assert torch.equal(other.state_dict()["lm_head.weight"], want_base["lm_head.weight"])

    # A plain model takes the base part (and computes what the elastic model does with B = 0).
    plain_sd = {k: v for k, v in sd.items() if ".lora_" not in k}
    fresh_plain = tiny_llama(seed=1)
    fresh_plain.load_state_dict(plain_sd)
    torch.testing.assert_close(_logits(fresh_plain), _logits(_converted_no_lora_b()), **TOL)

    errors = {}
    bad = dict(sd)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 32)
    try:
        other.load_state_dict(bad)
    except RuntimeError as e:
        errors["shape"] = str(e)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.down_proj.weight"}
    try:
        other.load_state_dict(missing)
    except RuntimeError as e:
        errors["missing"] = str(e)
    non_strict = other.load_state_dict(plain_sd, strict=False)

    # A rank that will not write joins the gathers but keeps nothing (ElasticTrainer's non-writers).
    from elastic_kernels.api.nn import gather_only

    if rank == 1:
        with gather_only():
            partial = model.state_dict()
        assert "model.layers.0.self_attn.q_proj.weight" not in partial and "model.embed_tokens.weight" in partial
    else:
        assert torch.equal(model.state_dict()["lm_head.weight"], want_base["lm_head.weight"])

    # Merged back to plain layers, then converted again: the new layers get the hooks too.
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, merge_adapters

    merged = merge_adapters(model)
    merged_sd = {k: v.clone() for k, v in merged.state_dict().items()}
    again = convert_to_elastic(merged, LoRAConfig(r=2, alpha=2, target_modules=("k_proj",)), ElasticPolicy(**POLICY))
    again_sd = again.state_dict()
    assert all(torch.equal(again_sd[k], v) for k, v in merged_sd.items())
    assert sorted(set(again_sd) - set(merged_sd)) == [
        f"model.layers.{i}.self_attn.k_proj.lora_{x}.weight" for i in (0, 1) for x in "AB"]
    return errors, sorted(non_strict.missing_keys), lora_keys


def _converted_no_lora_b():
    model = _converted()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    return model


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dict_round_trip(world_size):
    results = run_distributed(_state_dict_worker, world_size, timeout=240)
    errors, non_strict_missing, lora_keys = results[0]
    assert "size mismatch for model.layers.0.self_attn.q_proj.weight" in errors["shape"], errors
    assert "model.layers.1.mlp.down_proj.weight" in errors["missing"], errors
    assert non_strict_missing == lora_keys  # base weights loaded, adapters reported missing


# ---------------------------------------------------------------------------- save_pretrained


def _save_pretrained_worker(rank, world_size, tmp):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = _converted()
    want = _logits(model)
    out, merged = os.path.join(tmp, "out"), os.path.join(tmp, "merged")
    model.save_pretrained(out)  # every rank: the full state dict is a collective
    model.save_pretrained(merged, merged=True)
    if rank != 0:
        return None
    files = sorted(os.listdir(out))
    base_keys = sorted(load_file(os.path.join(out, "model.safetensors")))
    adapter_keys = sorted(load_file(os.path.join(out, "adapter_model.safetensors")))
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers' PEFT integration attaches the adapter
    got_auto = _logits(reloaded)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out), out)
    got_peft = _logits(peft)
    got_merged = _logits(AutoModelForCausalLM.from_pretrained(merged))
    return want, files, base_keys, adapter_keys, got_auto, got_peft, got_merged, sorted(os.listdir(merged))


@pytest.mark.parametrize("world_size", [1, 2])
def test_save_pretrained_reloads_to_same_logits(world_size, tmp_path):
    want, files, base_keys, adapter_keys, got_auto, got_peft, got_merged, merged_files = run_distributed(
        _save_pretrained_worker, world_size, str(tmp_path), timeout=300)[0]
    assert {"config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= set(files)
    assert not any("lora" in k for k in base_keys)
    assert "model.layers.0.self_attn.q_proj.weight" in base_keys and "lm_head.weight" in base_keys
    assert adapter_keys == sorted(
        f"base_model.model.model.layers.{i}.{m}.lora_{x}.weight"
        for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for x in "AB")
    for got in (got_auto, got_peft, got_merged):
        torch.testing.assert_close(got, want, **TOL)
    assert "adapter_config.json" not in merged_files


# ---------------------------------------------------------------------------- Trainer


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=8, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 9), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, max_steps=2, per_device_train_batch_size=2, learning_rate=5e-2, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, ddp_backend="gloo", **kw,
    )


def _trainer_one_process_worker(rank, world_size, tmp):
    from transformers import AutoModelForCausalLM, Trainer

    model = _converted()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = Trainer(model=model, args=_args(tmp), train_dataset=_Rows())
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad), "no step"
    model.eval()
    want = _logits(model)
    saved = os.path.join(tmp, "saved")
    trainer.save_model(saved)
    got = _logits(AutoModelForCausalLM.from_pretrained(saved))

    # Resuming: the plain Trainer restores the base weights only; ElasticTrainer the adapters too.
    from elastic_kernels.api import hf

    fresh_plain, fresh = _converted(seed=1), _converted(seed=1)
    Trainer(model=fresh_plain, args=_args(tmp))._load_from_checkpoint(saved)
    hf.ElasticTrainer(model=fresh, args=_args(tmp))._load_from_checkpoint(saved)
    return want, got, _logits(fresh_plain), _logits(fresh)


def test_trainer_save_model_one_process(tmp_path):
    want, got, resumed_plain, resumed = run_distributed(_trainer_one_process_worker, 1, str(tmp_path), timeout=300)[0]
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.allclose(resumed_plain, want, **TOL)  # adapters left as initialised
    assert torch.equal(resumed, want)  # same chunking, same values: bit for bit


def _trainer_two_ranks_worker(rank, world_size, tmp):
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import hf

    # What torchrun would set; accelerate reads them (the process group itself is already up).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    model = _converted()
    calls = []
    real = torch.distributed.all_reduce

    def counting(tensor, *a, **k):
        calls.append(tensor.numel())
        return real(tensor, *a, **k)

    torch.distributed.all_reduce = counting
    try:
        trainer = hf.ElasticTrainer(model=model, args=_args(tmp), train_dataset=_Rows(seed=rank))
        trainer.train()
    finally:
        torch.distributed.all_reduce = real
    wrapped = type(trainer.model_wrapped).__name__
    model.eval()
    want = _logits(model)

    # The plain Trainer (refused on several ranks since issue 28: tests/hf/test_user_script.py)
    # saved on rank 0 alone: a full state dict on one rank fails within the timeout, the other
    # returns. A short timeout for this part only (training under load may lag more than 3 s).
    import dataclasses

    from elastic_kernels.api.nn import runtime_of

    rt = runtime_of(model)
    policy = rt.policy
    rt.policy = dataclasses.replace(policy, collective_timeout_s=3.0)
    torch.distributed.barrier()
    t0 = time.monotonic()
    plain_error = None
    try:
        if rank == 0:
            model.state_dict()
    except RuntimeError as e:
        plain_error = str(e)
    plain_s = time.monotonic() - t0
    # Rank 1 must not start another export before rank 0 gave up: exports meet by their order
    # number, so its next state_dict would pair with rank 0's pending one.
    torch.distributed.barrier()
    rt.policy = policy

    # ElasticTrainer: the adapter only by default; with save_full_model, gathers on every rank.
    trainer.save_model(os.path.join(tmp, "adapter"))
    hf.ElasticTrainer(model=model, args=_args(tmp), save_full_model=True).save_model(os.path.join(tmp, "saved"))
    torch.distributed.barrier()
    got = got_adapter = None
    if rank == 0:
        from peft import PeftModel

        got = _logits(AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "saved")))
        assert "model.safetensors" not in os.listdir(os.path.join(tmp, "adapter"))
        got_adapter = _logits(PeftModel.from_pretrained(tiny_llama(), os.path.join(tmp, "adapter")).eval())
    return wrapped, calls, want, plain_error, plain_s, (got, got_adapter)


def test_trainer_on_two_ranks(tmp_path):
    results = run_distributed(_trainer_two_ranks_worker, 2, str(tmp_path), timeout=400)
    (wrapped, calls, want, plain_error, plain_s, got), (_, calls1, want1, plain_error1, _, _) = results
    assert wrapped == "DistributedDataParallel"
    # DDP averages the adapter gradients (its C++ reducer); the runtime issued no all-reduce.
    assert calls == [] and calls1 == [], (calls, calls1)
    torch.testing.assert_close(want, want1, rtol=0, atol=0)  # the ranks stayed identical
    assert plain_error is not None and "ElasticTrainer" in plain_error and "[1]" in plain_error, plain_error
    assert plain_s < 30
    assert plain_error1 is None  # rank 1 returned from _save at once, as the Trainer does
    torch.testing.assert_close(got[0], want, **TOL)
    torch.testing.assert_close(got[1], want, **TOL)


# ---------------------------------------------------------------------------- DDP


def _ddp_worker(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic_kernels.api.nn import no_sync

    # DDP refuses a module whose trainable parameters are all ignored, so it cannot be told to
    # leave the adapters to the runtime (see [Note: DDP and the runtime's all-reduce]).
    probe = _converted()
    DDP._set_params_and_buffers_to_ignore_for_model(probe, [n for n, p in probe.named_parameters() if p.requires_grad])
    refused = None
    try:
        DDP(probe)
    except RuntimeError as e:
        refused = str(e)

    wrapped_model, alone = _converted(), _converted()
    ddp = DDP(wrapped_model)
    hook_numel = []

    def counting_hook(state, bucket):
        hook_numel.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    calls = []
    real = torch.distributed.all_reduce

    def counting(tensor, *a, **k):
        calls.append(tensor.numel())
        return real(tensor, *a, **k)

    n_adapter = sum(p.numel() for p in alone.parameters() if p.requires_grad)
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank: averaging matters
    batches = [torch.randint(0, 64, (2, 9), generator=gen) for _ in range(3)]
    per_step = []
    torch.distributed.all_reduce = counting
    try:
        # step 1: one micro-batch; step 2: two, the first under no_sync (DDP's / the runtime's).
        for step, micro in enumerate(([batches[0]], batches[1:])):
            for i, ids in enumerate(micro):
                last = i == len(micro) - 1
                calls.clear()
                hook_numel.clear()
                with (ddp.no_sync() if not last else _null()):
                    ddp(input_ids=ids, labels=ids).loss.backward()
                ddp_calls, ddp_numel = list(calls), list(hook_numel)
                calls.clear()
                with (no_sync(alone) if not last else _null()):
                    alone(input_ids=ids, labels=ids).loss.backward()
                per_step.append((step, last, ddp_calls, ddp_numel, list(calls)))
            for (n, p), q in zip(wrapped_model.named_parameters(), alone.parameters()):
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
                    with torch.no_grad():
                        p -= 0.1 * p.grad
                        q -= 0.1 * q.grad
                    p.grad = q.grad = None
    finally:
        torch.distributed.all_reduce = real
    return refused, n_adapter, per_step


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_ddp_reduces_once():
    refused, n_adapter, per_step = run_distributed(_ddp_worker, 2, timeout=240)[0]
    assert refused is not None and "DistributedDataParallel is not needed" in refused
    for step, last, ddp_calls, ddp_numel, alone_calls in per_step:
        where = f"step {step}, {'last' if last else 'accumulating'} micro-batch"
        if last:
            # Under DDP: DDP's buckets carry every adapter gradient once; the runtime adds nothing
            # (DDP's allreduce_hook calls dist.all_reduce once per bucket, nothing else does).
            assert sum(ddp_numel) == n_adapter and ddp_calls == ddp_numel, where
            assert alone_calls == [n_adapter], where  # alone: the runtime's single all-reduce
        else:
            assert ddp_calls == [] and ddp_numel == [] and alone_calls == [], where


# ---------------------------------------------------------------------------- save_adapter errors


def _unwritable_worker(rank, world_size, tmp):
    from elastic_kernels.api.nn import save_adapter

    model = _converted()
    blocker = os.path.join(tmp, "a_file")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory\n")
    torch.distributed.barrier()
    out = {}
    for what, save in (("adapter", lambda p: save_adapter(model, p)), ("pretrained", model.save_pretrained)):
        t0 = time.monotonic()
        try:
            save(os.path.join(blocker, what))
            out[what] = (None, time.monotonic() - t0)
        except RuntimeError as e:
            out[what] = (str(e), time.monotonic() - t0)
    return out


def test_save_errors_on_every_rank(tmp_path):
    r0, r1 = run_distributed(_unwritable_worker, 2, str(tmp_path), timeout=120)
    for what, call in (("adapter", "save_adapter"), ("pretrained", "save_pretrained")):
        (e0, t0), (e1, t1) = r0[what], r1[what]
        assert e0 is not None and e0 == e1, (e0, e1)
        assert call in e0 and "failed on rank 0" in e0 and "a_file" in e0, e0
        assert max(t0, t1) < 10


# ---------------------------------------------------------------------------- Conv1D (GPT-2)


def _gpt2_worker(rank, world_size, tmp):
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic
    from tests.nn.test_lora_setups import tiny_gpt2

    want_base = tiny_gpt2().state_dict()

    def converted(seed):
        model = convert_to_elastic(tiny_gpt2(seed), LoRAConfig(r=4, alpha=8, target_modules=("c_attn", "c_fc")),
                                   ElasticPolicy(chunk_bytes=32 * 4 * 5, replicate_below_bytes=0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
        return model

    model = converted(0)
    sd = model.state_dict()
    base = {k: v for k, v in sd.items() if ".lora_" not in k}
    assert sorted(base) == sorted(want_base)
    for k, v in want_base.items():  # Conv1D weights come back as [in, out]
        assert torch.equal(base[k], v), k
    want = _logits(model)
    other = converted(1)
    other.load_state_dict(sd)
    assert torch.equal(_logits(other), want)
    out = os.path.join(tmp, "gpt2")
    model.save_pretrained(out)
    got = _logits(AutoModelForCausalLM.from_pretrained(out)) if rank == 0 else want
    return want, got


def test_conv1d_state_dict_and_save_pretrained(tmp_path):
    want, got = run_distributed(_gpt2_worker, 2, str(tmp_path), timeout=300)[0]
    torch.testing.assert_close(got, want, **TOL)


# ------------------------------------------------- adapters that load everywhere (issue 26/28)


def test_auto_peft_model_loads_saved_adapter(tmp_path):
    """[Note: adapters that load everywhere]: save_adapter records task_type and the base's
    directory, so AutoPeftModelForCausalLM builds base + adapter from the adapter folder alone
    and computes the converted model's logits. On main before this change both fields were
    null and AutoPeftModelForCausalLM failed ("Cannot infer the auto class")."""
    import json

    from peft import AutoPeftModelForCausalLM

    from elastic_kernels.api import ElasticPolicy, save_adapter
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    base_dir = tmp_path / "base"
    tiny_llama().save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    model = convert_to_elastic(AutoModelForCausalLM.from_pretrained(base_dir),
                               LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**POLICY))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    want = _logits(model)
    save_adapter(model, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(base_dir)
    save_adapter(model, str(tmp_path / "named"), base_model_name_or_path="org/some-model")
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/some-model"
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    with torch.no_grad():
        got = loaded(input_ids=_ids()).logits
    torch.testing.assert_close(got, want, **TOL)


def test_adapter_of_a_model_built_in_code_has_no_base_name(tmp_path):
    import json

    from elastic_kernels.api import save_adapter

    model = _converted()
    save_adapter(model, str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] is None
