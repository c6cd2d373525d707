"""A frozen embedding whose table is an elastic tensor: `ElasticEmbedding`. Putting a model's
embeddings under the runtime (and a tied output layer with them): convert.py.

[Note: embeddings under the runtime]
With `ElasticPolicy.shard_embeddings=True` (default False, see the last item) an
`nn.Embedding` of a converted model of at least `replicate_below_bytes` bytes (like the other
non-target linears) becomes an `ElasticEmbedding`: its table [num_embeddings, embedding_dim]
is registered with the runtime like a linear's weight [out, in] (rows = token ids), so it is
sharded, gathered into pool pages or a resident run, budgeted, prefetched in the learned
order and held in the host tier like every frozen weight.
- A lookup gathers the whole table through the runtime (`rt.use`) and reads its rows from the
  gathered chunks: `F.embedding` on the run when the table is held whole (a resident run,
  [Note: resident runs] in python_api/runtime/tensor.py), else an index_select per chunk the
  ids fall in, copied into the output: the same bytes as `F.embedding` (a copy of rows, no
  arithmetic), so the output is bit for bit the plain layer's. Gathering only the rows a batch
  reads was not built: the runtime's unit is a chunk whose rows are split across ranks at
  element granularity (chunk-major slices, not whole rows) and the rows each rank reads differ
  (the ids are per rank), so it needs an id exchange and a row-addressed collective outside
  the pool and the learned prefetch; and with a tied output layer (SmolLM2) the head's forward
  and backward need the whole table anyway, so rows alone would save one of three gathers,
  not the peak (below).
- Tied output layer: a frozen `nn.Linear` (not a LoRA target) whose weight IS the embedding's
  (`tie_word_embeddings`, GPT-2's wte/lm_head) becomes an `ElasticLinear` on the *same*
  `ElasticTensor`: one registration, one shard, one copy in the pool, used three times a
  step (lookup, head forward, head backward). The tie is kept as that relation:
  `model.get_input_embeddings().et is model.get_output_embeddings().et` (neither has a
  `.weight`: the table lives in the runtime). The state dict holds both original keys with one
  gathered tensor (transformers' save_pretrained then writes it once, as for a plain tied
  model); `merge_adapters` gives back an `nn.Embedding` and an `nn.Linear` sharing one
  Parameter.
- Kept replicated (as before): an embedding whose weight another module uses in another way
  (a LoRA target tied to it is refused, as before), one with `max_norm` (a lookup renormalises
  the table in place), subclasses of `nn.Embedding` (their forward may do more than a lookup,
  e.g. a scaled embedding), and embeddings below `replicate_below_bytes`.
- Weight formats: an embedding is never quantized (bitsandbytes quantizes linears only, and
  QLoRA keeps the output layer in full precision: [Note: what QLoRA keeps in full precision]
  in convert.py): conversion adds every sharded embedding's name to `quant_skip_modules`, so
  a tied output layer stays in full precision with it.
- Bytes: at budget 0 the table is gathered once per step for the lookup ((W-1)/W of its padded
  bytes on each rank), and a tied table twice more (head forward and backward), where before
  nothing of it was gathered (tests/nn/test_elastic_embedding.py counts them exactly).
- Why the default is False: measured on SmolLM2-135M (tied, vocab 49152 x 576, fp32; 2 gloo
  ranks, budget 0, bench/results/2026-12-03_embeddings.md), sharding the table takes the
  static tensors per rank from 333.0 to 279.0 MiB (FSDP2: 261.2; what is left above it is
  the shards' ragged-chunk padding, 13.1 MiB, and the replicated adapters, 9.3 MiB against
  FSDP2's 4.7) but the tensor peak from 623.8 to 861.8 MiB (FSDP2: 635.7): a use gathers the
  whole table at once, into 435 pool pages (the pool's working set grows from two decoder
  layers to the table plus one) through coalesced all-gathers that are all in flight
  together, each with its W-slice receive buffer and its packed send buffer, where FSDP2
  lands the table in one flat buffer. Until a table is gathered in bounded pieces (e.g. row
  blocks registered as separate tensors, each its own unit, prefetched one ahead like the
  decoder layers; or a cap on one use's bytes in flight in the runtime), sharding it lowers
  static memory and raises the peak, so it is opt-in.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime import ElasticTensor, Phase
from .linear import refuse_conversion


def can_shard_embedding(module: nn.Module) -> bool:
    """An embedding `convert_to_elastic` may put under the runtime ([Note: embeddings under the
    runtime]): a plain `nn.Embedding` (not a subclass), 2-D, without `max_norm`."""
    return type(module) is nn.Embedding and module.max_norm is None and module.weight.dim() == 2


class ElasticEmbedding(nn.Module):
    """A frozen embedding whose table is an elastic tensor (same call as `nn.Embedding`)."""

    def __init__(self, et: ElasticTensor, padding_idx: int | None = None):
        super().__init__()
        if et.qlayout is not None:
            raise ValueError(f"{et.name}: an embedding table is never quantized ([Note: embeddings under the runtime])")
        self.et = et
        self.num_embeddings, self.embedding_dim = et.shape
        self.padding_idx = padding_idx

    @torch.compiler.disable  # talks to the runtime: [Note: torch.compile] in linear.py
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        et = self.et
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{et.name}: the input must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{et.name}: token ids must be int64 or int32, got {ids.dtype}")
        if ids.device != et.device:
            raise ValueError(f"{et.name}: token ids are on {ids.device}, the table lives on {et.device}")
        flat = ids.reshape(-1)
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(f"{et.name}: token id {lo if lo < 0 else hi} is out of range for an embedding of "
                                 f"{self.num_embeddings} rows")
        rt = et.runtime
        with torch.no_grad(), rt.use(et, Phase.FORWARD, needs_backward=False) as resident:
            whole = resident.whole()
            if whole is not None:  # a resident run: one lookup
                return F.embedding(ids, whole)
            chunks = resident.chunks()
            out = torch.empty(flat.numel(), self.embedding_dim, dtype=et.dtype, device=et.device)
            rpc = et.layout.rows_per_chunk
            which = torch.div(flat, rpc, rounding_mode="floor")
            for c in torch.unique(which).tolist():
                sel = (which == c).nonzero().squeeze(1)
                out.index_copy_(0, sel, chunks[c].index_select(0, flat.index_select(0, sel) - c * rpc))
            return out.view(*ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse=True):
        refuse_conversion(self, fn)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, chunks={self.et.num_chunks}, "
                f"world_size={self.et.layout.world_size}")
