"""Shared pieces of the pipeline tests: tiny HF models, their LoRA, batches, and the pp = 1
reference the pipelined runs are compared with.

[Note: the reference and the tolerance]
The reference is the pp = 1 computation of the same global batch on one process: the same
HF model converted with convert_to_elastic (world size 1: chunks are views of the weight),
the same adapters, gradient accumulation over the global batch's dp x m micro-batches of
micro_batch_size sequences, each micro-batch's loss (HF's token mean) divided by dp x m. The
pipelined run computes, per dp group, the schedule's sum of its m micro-batch gradients
divided by m, then the mean over the dp group: the same sum of the same per-micro-batch
gradients, grouped and ordered differently (and for dp > 1 through an all-reduce). So the
two agree to fp32 summation-order rounding: each gradient entry is a sum of products over
tokens, heads and micro-batches; reordering a sum of n fp32 terms changes it by at most
~n u sum|terms| (u = 2^-24 ~ 6e-8), a few 1e-7 relative to the gradient's scale for these
sizes (n ~ 10^3..10^4 but with random signs the error grows like sqrt(n)). Measured in the
spike: <= 4.1e-8 absolute, <= 1.1e-6 relative. The tests assert, per tensor,
|g - g_ref| <= 1e-5 x max|g_ref| + 1e-6 x |g_ref| elementwise (assert_close with
atol = 1e-5 max|g_ref|, rtol = 1e-6), and |loss - loss_ref| <= 1e-6 x loss: tight enough that
a dropped micro-batch, a missing 1/m or 1/dp, a stale weight or a wrong position id (each
measured at >= 1e-3 relative) fails.
"""

from __future__ import annotations

import copy
import zlib

import torch

VOCAB = 257
SEQ = 16
MBS = 2


def tiny_model(kind: str, n_layers: int, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=False)
        return LlamaForCausalLM(cfg).train()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=n_layers, n_head=4, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).train()


def lora_of(kind: str):
    from elastic_kernels.api import LoRAConfig

    targets = ("q_proj", "v_proj", "o_proj", "down_proj") if kind == "llama" else ("c_attn", "c_proj", "c_fc")
    return LoRAConfig(r=4, alpha=8, target_modules=targets)


def randomize_lora_b(named_params) -> None:
    """PEFT's B starts at 0, which makes every lora_A gradient 0 at the first step: give each
    B a value drawn from its own name, the same in every model and on every rank."""
    with torch.no_grad():
        for name, p in named_params:
            if name.endswith("lora_B.weight"):
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def global_batch(step: int, dp: int, m: int, seed: int = 1234) -> torch.Tensor:
    """[dp, m * MBS, SEQ] token ids: dp group d's share is [d]."""
    gen = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, VOCAB, (dp, m * MBS, SEQ), generator=gen)


def reference_of(lm, lora, chunk_bytes: int):
    """The pp = 1 elastic model of a copy of `lm` in a process group of one
    ([Note: the reference and the tolerance])."""
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy, convert_to_elastic

    ref = copy.deepcopy(lm)
    group = None
    if dist.is_initialized():
        group = _solo_group()
    convert_to_elastic(ref, lora, ElasticPolicy(chunk_bytes=chunk_bytes, all_reduce_grads=False), group=group)
    randomize_lora_b(ref.named_parameters())
    return ref


_SOLO = {}


def _solo_group():
    """A group of this rank alone (every rank creates every rank's, in the same order)."""
    import torch.distributed as dist

    if "g" not in _SOLO:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _SOLO["g"] = groups[dist.get_rank()]
    return _SOLO["g"]


def reference_step(ref, batch: torch.Tensor):
    """Loss and adapter gradients of the global batch [dp, m * MBS, SEQ] on the reference."""
    for p in ref.parameters():
        p.grad = None
    dp, rows, _ = batch.shape
    m = rows // MBS
    chunks = [batch[d, i * MBS:(i + 1) * MBS] for d in range(dp) for i in range(m)]
    total = 0.0
    for ids in chunks:
        loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
        (loss / len(chunks)).backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    return total / len(chunks), grads


def assert_grads_close(got: dict, ref: dict, what: str) -> float:
    """[Note: the reference and the tolerance]; returns the largest difference relative to
    each tensor's scale."""
    worst = 0.0
    assert got, f"{what}: no adapter gradient on this rank"
    for name, g in got.items():
        assert name in ref, f"{what}: {name} has no reference"
        r = ref[name]
        assert g is not None, f"{what}: {name} got no gradient"
        scale = float(r.abs().max())
        assert scale > 0, f"{what}: the reference gradient of {name} is zero (the test would prove nothing)"
        torch.testing.assert_close(g, r, atol=1e-5 * scale, rtol=1e-6, msg=lambda m: f"{what}: {name}: {m}")
        worst = max(worst, float((g - r).abs().max()) / scale)
    return worst
