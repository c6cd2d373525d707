"""Packs of a Hugging Face causal LM: the module one virtual stage runs, built by hand (not
traced: `pipeline()`/`SplitPoint` fails on HF models with rotary embeddings, pytorch#184361).

    arch = architecture_of(lm)                    # Llama family or GPT-2, else PipelineError
    pack = arch.pack(lm, layer_ids=range(4, 8), first=False, last=False)
    hidden = pack(hidden, position_ids)           # [B, S, H] -> [B, S, H] (logits on the last pack)

[Note: what a pack computes]
A pack holds *references* to the HF model's own submodules (the same Parameter objects), under
the names they have in the HF model: `model.layers.5.self_attn.q_proj` in a Llama pack is the
module of that name in LlamaForCausalLM (the layers sit in a ModuleDict keyed by their
index). So convert_to_elastic on a pack names its layers, seeds its adapters
([Note: initialisation and replication] in python_api/nn/lora.py), checks them across the dp
replicas and reads them from safetensors files exactly as on the whole model: the adapters of
a pipelined run are, name for name and value for value, those of the pp = 1 run.
The first pack also holds the embeddings (GPT-2: wte, wpe and the embedding dropout), the last
the final norm and lm_head (the loss is the schedule's loss_fn on the last pack's logits, the
model's own `loss_function`). What the HF model computes once per forward, each pack
recomputes from the micro-batch's position_ids: the rotary (cos, sin) of Llama (every pack
holds the model's `rotary_emb`, whose only state is its inv_freq buffer) and the causal mask
(`create_causal_mask`; None with sdpa and no padding, which then runs is_causal). Only the
hidden state crosses stages. The layers run with `past_key_values=None, use_cache=False`:
HF's default `use_cache=True` creates a cache, and with a cache `create_causal_mask` skips the
detection of packed sequences, so the reference (the pp = 1 model) must run with
use_cache=False too when positions restart inside a row (FINDINGS.md Q2); with the
position_ids of unpacked rows both give the same mask.
A tied lm_head (GPT-2: lm_head.weight is wte.weight) keeps the tie inside the last pack: it
holds the embedding module too (unused in its forward), so convert_to_elastic sees the shared
weight and keeps it replicated as on the whole model, and loading from files reads the one
stored tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..planner.pipeline import PipelineError


class _Holder(nn.Module):
    """A plain container giving the referenced submodules their HF names."""


def check_checkpointing(layer: nn.Module, name: str) -> None:
    """Refuse reentrant activation checkpointing: under a pipeline the first stage's input (the
    embeddings' output) needs no gradient, so `checkpoint(use_reentrant=True)` returns an
    output without grad_fn and that stage's LoRA gradients are silently dropped (measured:
    every adapter of stage 0 got no gradient, no error; FINDINGS.md Q6)."""
    if not getattr(layer, "gradient_checkpointing", False):
        return
    fn = getattr(layer, "_gradient_checkpointing_func", None)
    if isinstance(fn, functools.partial) and fn.keywords.get("use_reentrant") is False:
        return
    raise PipelineError(
        f"{name} uses reentrant activation checkpointing (use_reentrant is not False), which drops the LoRA "
        f"gradients of the first pipeline stage without an error; enable it non-reentrant: "
        f"model.activation_checkpointing_enable(activation_checkpointing_kwargs={{'use_reentrant': False}})"
    )


class _Pack(nn.Module):
    """What every pack shares: its place and the config (a plain attribute, not a module)."""

    def __init__(self, lm: nn.Module, layer_ids, first: bool, last: bool):
        super().__init__()
        self.config = lm.config
        self.first, self.last = bool(first), bool(last)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        # Where loading from files finds this pack's tensors (SafetensorsSource.resolve).
        self.base_model_prefix = getattr(lm, "base_model_prefix", "")
        if not self.layer_ids:
            raise PipelineError("a pack needs at least one decoder layer")

    @staticmethod
    def _positions(h: torch.Tensor, position_ids):
        if position_ids is None:
            return torch.arange(h.shape[1], device=h.device).unsqueeze(0).expand(h.shape[0], -1)
        return position_ids

    def _mask(self, h: torch.Tensor, position_ids):
        from transformers.masking_utils import create_causal_mask

        return create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)


class LlamaPack(_Pack):
    """Consecutive LlamaDecoderLayers ([Note: what a pack computes])."""

    def __init__(self, lm: nn.Module, layer_ids, first: bool, last: bool):
        super().__init__(lm, layer_ids, first, last)
        base = lm.model
        self.model = _Holder()
        tied = lm.lm_head.weight is base.embed_tokens.weight
        if first or (last and tied):
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in self.layer_ids})
        self.model.rotary_emb = base.rotary_emb
        if last:
            self.model.norm = base.norm
            self.lm_head = lm.lm_head

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        position_ids = self._positions(h, position_ids)
        mask = self._mask(h, position_ids)
        pe = self.model.rotary_emb(h, position_ids=position_ids)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=position_ids,
                      past_key_values=None, use_cache=False)
        if self.last:
            h = self.lm_head(self.model.norm(h))
        return h


class GPT2Pack(_Pack):
    """Consecutive GPT2Blocks ([Note: what a pack computes])."""

    def __init__(self, lm: nn.Module, layer_ids, first: bool, last: bool):
        super().__init__(lm, layer_ids, first, last)
        base = lm.transformer
        self.transformer = _Holder()
        tied = lm.lm_head.weight is base.wte.weight
        if first or (last and tied):
            self.transformer.wte = base.wte
        if first:
            self.transformer.wpe = base.wpe
            self.transformer.drop = base.drop
        self.transformer.h = nn.ModuleDict({str(i): base.h[i] for i in self.layer_ids})
        if last:
            self.transformer.ln_f = base.ln_f
            self.lm_head = lm.lm_head

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = self.transformer
        if self.first:
            position_ids = self._positions(x, position_ids)
            h = t.wte(x) + t.wpe(position_ids)
            h = t.drop(h)
        else:
            h = x
            position_ids = self._positions(h, position_ids)
        mask = self._mask(h, position_ids)
        for block in t.h.values():
            h = block(h, None, mask, None, use_cache=False, position_ids=position_ids)
        if self.last:
            h = self.lm_head(t.ln_f(h))
        return h


class Architecture:
    """One supported family: how to find its decoder layers and build its packs."""

    def __init__(self, name: str, pack_class, layers_of, embed_of, head_of, layer_prefix: str,
                 head_prefixes: tuple[str, ...]):
        self.name = name
        self.pack_class = pack_class
        self._layers_of, self._embed_of, self._head_of = layers_of, embed_of, head_of
        self.layer_prefix = layer_prefix  # "model.layers.": module names of decoder layer i start with it + "i."
        self.head_prefixes = head_prefixes  # modules of the last pack outside the layers (final norm, head)

    def is_head(self, name: str) -> bool:
        return any(name == h or name.startswith(h + ".") for h in self.head_prefixes)

    def embedding(self, lm: nn.Module) -> nn.Module:
        return self._embed_of(lm)

    def layers(self, lm: nn.Module) -> nn.ModuleList:
        return self._layers_of(lm)

    def layer_class_names(self, lm: nn.Module) -> tuple[str, ...]:
        return tuple(sorted({type(layer).__name__ for layer in self.layers(lm)}))

    def hidden_size(self, lm: nn.Module) -> int:
        c = lm.config
        return int(getattr(c, "hidden_size", None) or getattr(c, "n_embd"))

    def pack(self, lm: nn.Module, layer_ids, first: bool, last: bool) -> _Pack:
        layers = self.layers(lm)
        for i in layer_ids:
            check_checkpointing(layers[i], f"decoder layer {i} ({type(layers[i]).__name__})")
        return self.pack_class(lm, layer_ids, first, last)

    def embedding_numel(self, lm: nn.Module) -> int:
        return sum(p.numel() for p in self._embed_of(lm).parameters())

    def head_numel(self, lm: nn.Module) -> int:
        return sum(p.numel() for p in self._head_of(lm).parameters())


ARCHITECTURES = {
    "llama": Architecture("llama", LlamaPack, lambda lm: lm.model.layers, lambda lm: lm.model.embed_tokens,
                          lambda lm: lm.lm_head, "model.layers.", ("model.norm", "lm_head")),
    "gpt2": Architecture("gpt2", GPT2Pack, lambda lm: lm.transformer.h, lambda lm: lm.transformer.wte,
                         lambda lm: lm.lm_head, "transformer.h.", ("transformer.ln_f", "lm_head")),
}


def architecture_of(lm: nn.Module) -> Architecture:
    """The family of `lm` (a transformers causal LM), or a PipelineError naming what is
    supported."""
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(kind)
    cls = type(lm).__name__
    if arch is None:
        raise PipelineError(
            f"pipelines support the causal LMs of {', '.join(sorted(ARCHITECTURES))} (model_type), not "
            f"{cls} (model_type {kind!r}): its stages are built by hand from the decoder layers "
            f"(python_api/pipeline/hf_packs.py)")
    expected = {"llama": ("LlamaForCausalLM",), "gpt2": ("GPT2LMHeadModel",)}[kind]
    if cls not in expected and not any(c.__name__ in expected for c in type(lm).__mro__):
        raise PipelineError(f"a {kind} model for a pipeline must be a {' or '.join(expected)}, got {cls}")
    return arch
