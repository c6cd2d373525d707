"""A user's own training script on a converted model (issue 28): converting under a launcher
before any process group exists, adapter-only checkpoints of `ElasticTrainer` and their resume,
a plain `Trainer` refused on several ranks before step 1, and `accelerate`.

Exactness: resuming and the ranks' agreement are compared bit for bit (same chunking, same
values, same reduction order); the accelerate path against a single-process reference with
TOL (rtol = atol = 1e-4 in fp32, tests/nn/test_lora.py: chunked GEMMs and a 2-rank average
sum in another order).
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from tests._dist import run_distributed
from tests.hf.test_hf_save import _converted, _logits, _Rows

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]


def _args(out, **kw):
    from transformers import TrainingArguments

    kw = {**dict(max_steps=2, per_device_train_batch_size=2, learning_rate=5e-2, save_strategy="no"), **kw}
    return TrainingArguments(output_dir=out, use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True,
                             ddp_backend="gloo", **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_torchrun(rank, world_size, port):
    """Leave the helper's process group and set what torchrun sets: the script starts with no
    process group, as under a launcher."""
    import torch.distributed as dist

    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")


# ------------------------------------------------------------- the group under a launcher


def _convert_before_args_worker(rank, world_size, port, tmp):
    import torch.distributed as dist

    from elastic_kernels.api import hf
    from elastic_kernels.api.nn import runtime_of

    _as_torchrun(rank, world_size, port)
    assert not dist.is_initialized()
    model = _converted()  # the natural HF order: load, convert, then TrainingArguments
    rt = runtime_of(model)
    sharded = (rt.world_size, rt.rank, dist.is_initialized() and dist.get_backend())
    trainer = hf.ElasticTrainer(model=model, args=_args(tmp), train_dataset=_Rows(seed=rank))
    trainer.train()
    model.eval()
    return sharded, type(trainer.model_wrapped).__name__, trainer.args.world_size, _logits(model)


def test_convert_before_training_arguments_shards(tmp_path):
    results = run_distributed(_convert_before_args_worker, 2, _free_port(), str(tmp_path), timeout=300)
    for rank, (sharded, wrapped, args_world, _) in enumerate(results):
        assert sharded == (2, rank, "gloo"), sharded  # not a silent world size 1
        assert wrapped == "DistributedDataParallel" and args_world == 2
    # Different data per rank, averaged gradients: the ranks stayed identical.
    torch.testing.assert_close(results[0][3], results[1][3], rtol=0, atol=0)


def test_world_size_without_rendezvous_is_refused(monkeypatch):
    import torch.distributed as dist

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*torchrun.*init_process_group"):
        _converted()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="WORLD_SIZE is 'two'"):
        _converted()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process launch: a plain script
    from elastic_kernels.api.nn import runtime_of

    assert runtime_of(_converted()).world_size == 1 and not dist.is_initialized()


# ------------------------------------------------ adapter-only checkpoints, bit-exact resume


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _checkpoint_worker(rank, world_size, tmp):
    from elastic_kernels.api import hf

    out = os.path.join(tmp, "run")
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, learning_rate=1e-2)
    model = _converted()
    hf.ElasticTrainer(model=model, args=_args(out, **args), train_dataset=_Rows(seed=rank)).train()
    want = _adapters(model)
    # Resume from step 2 into a fresh model (the same base, as loaded again from its files;
    # other adapters): steps 3-4 again.
    other = _converted()
    with torch.no_grad():
        for p in other.parameters():
            if p.requires_grad:
                p.add_(1.0)
    trainer = hf.ElasticTrainer(model=other, args=_args(os.path.join(tmp, "resumed"), **args),
                                train_dataset=_Rows(seed=rank))
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    got = _adapters(other)
    trainer.save_model(os.path.join(tmp, "final"))
    torch.distributed.barrier()
    return want, got


def test_checkpoints_hold_the_adapter_only_and_resume_bit_exactly(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.nn.test_lora import tiny_llama

    results = run_distributed(_checkpoint_worker, 2, str(tmp_path), timeout=300)
    (want, got), (want1, got1) = results
    assert want.keys() == got.keys() and want
    for n in want:
        assert torch.equal(got[n], want[n]), n  # same chunking, same values, same order: bit for bit
        assert torch.equal(want1[n], want[n]), n  # the ranks agree
    for d in ("run/checkpoint-2", "run/checkpoint-4", "final"):
        files = set(os.listdir(tmp_path / d))
        assert {"adapter_model.safetensors", "adapter_config.json", "training_args.bin"} <= files, files
        assert not files & {"model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"}, files
        tensors = load_file(tmp_path / d / "adapter_model.safetensors")
        assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors), sorted(tensors)
    ckpt = set(os.listdir(tmp_path / "run/checkpoint-2"))
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json"} <= ckpt, ckpt
    # PEFT reads the saved adapter onto the plain model: an independent check of its content.
    peft = PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "final")).eval()
    model = _converted()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(want[n])
    torch.testing.assert_close(_logits(peft), _logits(model), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------ a plain Trainer on several ranks


def _plain_trainer_worker(rank, world_size, tmp):
    from transformers import Trainer

    from elastic_kernels.api import hf

    model = _converted()
    before = _adapters(model)
    t0 = time.monotonic()
    errors = []
    try:
        Trainer(model=model, args=_args(tmp), train_dataset=_Rows())
    except TypeError as e:
        errors.append(str(e))
    # A transformers version that no longer reads the flag at construction: the first
    # training forward refuses it (here: an ElasticTrainer turned into a plain one).
    trainer = hf.ElasticTrainer(model=model, args=_args(tmp), train_dataset=_Rows())
    trainer.__class__ = Trainer
    try:
        trainer.train()
    except TypeError as e:
        errors.append(str(e))
    seconds = time.monotonic() - t0
    unchanged = all(torch.equal(p, before[n]) for n, p in _adapters(model).items())
    return errors, seconds, unchanged


def test_plain_trainer_on_two_ranks_is_refused_before_step_one(tmp_path):
    for errors, seconds, unchanged in run_distributed(_plain_trainer_worker, 2, str(tmp_path), timeout=120):
        assert len(errors) == 2, errors
        for e in errors:
            assert "Trainer on a model converted by elastic_kernels across 2 ranks" in e and "ElasticTrainer" in e, e
        assert unchanged  # no optimizer step ran
        assert seconds < 30, seconds  # not the 300 s collective timeout of the first save


# ------------------------------------------------------------------------------ accelerate


def _accelerate_worker(rank, world_size, port):
    import torch.distributed as dist
    from accelerate import Accelerator

    from elastic_kernels.api.nn import lora_layers, runtime_of

    _as_torchrun(rank, world_size, port)
    accelerator = Accelerator(cpu=True)  # creates the process group, as under accelerate launch / torchrun
    model = _converted()
    assert runtime_of(model).world_size == 2 and dist.get_backend() == "gloo"
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)  # lr 0: the gradients are what is compared
    ids = _Rows(n=4, seed=3).ids  # 4 rows of 9 tokens: rows 2r, 2r+1 on rank r
    loader = torch.utils.data.DataLoader(ids, batch_size=2, shuffle=False)
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    (batch,) = list(loader)
    loss = wrapped(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    grads = {f"{name}.{w}": getattr(layer, w).weight.grad.clone()
             for name, layer in lora_layers(model) for w in ("lora_A", "lora_B")}
    adapters = {f"{name}.{w}": getattr(layer, w).weight.detach().clone()
                for name, layer in lora_layers(model) for w in ("lora_A", "lora_B")}
    return type(wrapped).__name__, batch, grads, adapters, ids


def test_accelerate_matches_one_process():
    from peft import LoraConfig, get_peft_model

    from tests.hf.test_hf_save import TARGETS
    from tests.nn.test_lora import TOL, tiny_llama

    results = run_distributed(_accelerate_worker, 2, _free_port(), timeout=300)
    (wrapped, batch0, grads0, adapters, ids), (_, batch1, grads1, _, _) = results
    assert wrapped == "DistributedDataParallel"
    assert torch.equal(torch.cat([batch0, batch1]), ids)  # each rank its own half of the data
    for k in grads0:
        torch.testing.assert_close(grads0[k], grads1[k], rtol=0, atol=0)  # averaged: the same on both
    # Reference: PEFT on the plain model, one process, the whole batch (equal token counts per
    # rank, so the mean over the batch is the average of the ranks' means).
    peft = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0))
    mods = dict(peft.base_model.model.named_modules())
    with torch.no_grad():
        for k, v in adapters.items():
            name, w = k.rsplit(".", 1)
            getattr(mods[name], w)["default"].weight.copy_(v)
    peft(input_ids=ids, labels=ids).loss.backward()
    for k in grads0:
        name, w = k.rsplit(".", 1)
        torch.testing.assert_close(grads0[k], getattr(mods[name], w)["default"].weight.grad, **TOL)


# ------------------------------------------------------------------------------------- TRL


def test_trl_with_an_elastic_output_layer_is_refused_when_built(tmp_path):
    """TRL's fused LM head reads the output layer's weight whole: an elastic one is refused
    when the trainer is built, naming the fix, not at the first step."""
    from trl import SFTConfig, SFTTrainer

    from elastic_kernels.api.hf import ElasticTrainerMixin

    class ElasticSFTTrainer(ElasticTrainerMixin, SFTTrainer):
        pass

    model = _converted()  # replicate_below_bytes=0: lm_head is elastic
    assert type(model.lm_head).__name__ == "ElasticLinear"
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"fused LM head .* ElasticPolicy\(replicate_below_bytes > 8192\)"):
        ElasticSFTTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3]}])


def _sft_model(vocab: int):
    """A tiny Llama with SmolLM2's vocabulary and a tied output layer (TRL's fused LM head reads
    it whole: tied, it stays replicated), the same in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


# Four chat records and a global batch of four: each of the two steps (epochs) trains on all of
# them, whatever order the Trainer's sampler draws, so 2 ranks x 2 rows and 1 process x 4 rows
# see the same batches.
_RECORDS = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(4)]


def _sft_args(out, per_device, **kw):
    """2 steps at lr 1e-2 in fp32 (TRL's default is bf16 autocast, where PEFT rounds differently:
    docs/huggingface.md); any field overridden by `kw`."""
    from trl import SFTConfig

    fields = dict(output_dir=out, max_steps=2, per_device_train_batch_size=per_device, learning_rate=1e-2,
                  lr_scheduler_type="constant", warmup_steps=0, max_length=64, save_strategy="no", logging_steps=1,
                  use_cpu=True, report_to=[], disable_tqdm=True, seed=0, data_seed=0, bf16=False)
    return SFTConfig(**(fields | kw))


def _peft_sft_run(tok, initial, out, **kw):
    """PEFT + SFTTrainer in one process on the 4 records in one batch, from the adapters
    `initial` ({module: (A, B)}): the logged losses and the adapters after training."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import SFTTrainer

    peft = get_peft_model(_sft_model(len(tok)), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    mods = dict(peft.base_model.model.named_modules())
    with torch.no_grad():
        for n, (a, b) in initial.items():
            mods[n].lora_A["default"].weight.copy_(a)
            mods[n].lora_B["default"].weight.copy_(b)
    trainer = SFTTrainer(model=peft, args=_sft_args(out, 4, **kw), train_dataset=Dataset.from_list(_RECORDS),
                         processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: (mods[n].lora_A["default"].weight, mods[n].lora_B["default"].weight) for n in initial}


def _trl_worker(rank, world_size, port, tokenizer_dir, tmp):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.hf import ElasticTrainerMixin
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers, runtime_of

    class ElasticSFTTrainer(ElasticTrainerMixin, SFTTrainer):
        pass

    _as_torchrun(rank, world_size, port)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = convert_to_elastic(_sft_model(len(tok)), LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
                               ElasticPolicy(chunk_bytes=32 * 4 * 5, replicate_below_bytes=0))
    gen = torch.Generator().manual_seed(7)  # B = 0 would hide A's gradient
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
    initial = {n: (l.lora_A.weight.detach().clone(), l.lora_B.weight.detach().clone()) for n, l in lora_layers(model)}
    trainer = ElasticSFTTrainer(model=model, args=_sft_args(tmp, 4 // world_size, ddp_backend="gloo"), train_dataset=Dataset.from_list(_RECORDS),
                                processing_class=tok)
    trainer.train()
    final = {n: (l.lora_A.weight.detach().clone(), l.lora_B.weight.detach().clone()) for n, l in lora_layers(model)}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return runtime_of(model).world_size, initial, final, losses


def test_sft_trainer_on_two_ranks_matches_peft_in_one_process(real_model, tmp_path):
    """TRL's SFTTrainer over chat records (TRL's own formatting with SmolLM2's chat template),
    2 gloo ranks with ElasticTrainerMixin, against PEFT + SFTTrainer in one process on the same
    global batches from the same adapters: the logged losses and the adapters after two AdamW
    steps agree within fp32 summation order (TOL: the runtime's chunked GEMMs, the 2-rank
    average of token sums)."""
    from transformers import AutoTokenizer

    from tests.nn.test_lora import TOL

    results = run_distributed(_trl_worker, 2, _free_port(), real_model, str(tmp_path / "elastic"), timeout=600)
    (world, initial, final, losses), (_, _, final1, losses1) = results
    assert world == 2
    for n in final:  # the ranks hold one adapter
        torch.testing.assert_close(final[n], final1[n], rtol=0, atol=0)
    assert losses == losses1 and len(losses) == 2

    ref_losses, ref_final = _peft_sft_run(AutoTokenizer.from_pretrained(real_model), initial, str(tmp_path / "peft"))
    print(f"losses: elastic on 2 ranks {losses}, PEFT in one process {ref_losses}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    moved = 0.0
    for n, (a, b) in final.items():
        torch.testing.assert_close(a, ref_final[n][0], **TOL)
        torch.testing.assert_close(b, ref_final[n][1], **TOL)
        moved = max(moved, (a - initial[n][0]).abs().max().item(), (b - initial[n][1]).abs().max().item())
    assert moved > 1e-3  # the steps moved the adapters (lr 1e-2): the comparison is not of the initial values


# ----------------------------------------------------------- accelerate's FSDP / DeepSpeed


@pytest.mark.parametrize("how", ["fsdp", "deepspeed", "accelerate-env"])
def test_fsdp_or_deepspeed_integration_is_refused_on_an_elastic_model(tmp_path, monkeypatch, how):
    """The Trainer's FSDP / DeepSpeed integration (its arguments, or accelerate launch's plugin
    through the environment) would wrap a model whose frozen weights the runtime shards already:
    refused when the trainer is built, naming what asked for it and the fix."""
    from transformers import TrainingArguments

    from elastic_kernels.api.hf import ElasticTrainer

    kw = {"fsdp": dict(fsdp=True), "deepspeed": dict(deepspeed={"zero_optimization": {"stage": 3},
                                                                 "train_micro_batch_size_per_gpu": 1}),
          "accelerate-env": {}}[how]
    if how == "accelerate-env":
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
    named = {"fsdp": r"TrainingArguments\(fsdp=\.\.\.\)", "deepspeed": r"TrainingArguments\(deepspeed=\.\.\.\)",
             "accelerate-env": r"ACCELERATE_USE_FSDP=true \(accelerate launch's plugin\)"}[how]
    with pytest.raises(ValueError, match=rf"ElasticTrainer: {named} on a model converted by elastic_kernels: .*"
                                         r"sharded by the elastic runtime already"):
        ElasticTrainer(model=_converted(), args=args, train_dataset=_Rows())
