"""A frozen embedding whose table is held by the runtime in row blocks (`ElasticEmbedding`), and
an output layer on row blocks (`ElasticBlocksLinear`: a tied head shares its embedding's
blocks). Putting a model's embeddings under the runtime: convert.py.

[Note: embeddings under the runtime]
With `ElasticPolicy.shard_embeddings=True` (default False, see the last item) an
`nn.Embedding` of a converted model of at least `replicate_below_bytes` bytes (like the other
non-target linears) becomes an `ElasticEmbedding`: its table [num_embeddings, embedding_dim]
is registered with the runtime like a linear's weight [out, in] (rows = token ids), in row
blocks ([Note: a table in row blocks]), so it is sharded, gathered into pool pages or a
resident run, budgeted, prefetched in the learned order and held in the host tier like every
frozen weight. A lookup exchanges only the rows it reads ([Note: a lookup reads only its rows]).
- Output layer: a frozen `nn.Linear` (not a LoRA target) whose weight IS the embedding's
  (`tie_word_embeddings`, GPT-2's wte/lm_head) becomes an `ElasticBlocksLinear` on the *same*
  row blocks: one registration each, one shard, one copy in the pool. The tie is kept as that
  relation: `model.get_input_embeddings().ets is model.get_output_embeddings().ets` (neither
  has a `.weight`: the table lives in the runtime). The state dict holds both original keys
  with one gathered tensor (the blocks concatenated; transformers' save_pretrained then writes
  it once, as for a plain tied model); `merge_adapters` gives back an `nn.Embedding` and an
  `nn.Linear` sharing one Parameter. An untied output layer (the model's
  `get_output_embeddings()`, a frozen non-target `nn.Linear`, not quantized) is held in row
  blocks of its own the same way.
- Kept replicated (as before): an embedding whose weight another module uses in another way
  (a LoRA target tied to it is refused, as before), one with `max_norm` (a lookup renormalises
  the table in place), subclasses of `nn.Embedding` (their forward may do more than a lookup,
  e.g. a scaled embedding), and embeddings below `replicate_below_bytes`.
- Weight formats: an embedding is never quantized (bitsandbytes quantizes linears only, and
  QLoRA keeps the output layer in full precision: [Note: what QLoRA keeps in full precision]
  in convert.py): conversion adds every sharded embedding's name to `quant_skip_modules`, so
  a tied output layer stays in full precision with it (the blocks' names,
  "<name>.rows<begin>-<end>", fall under it).
- Bytes at budget 0, per step: a head's blocks are gathered in its forward and backward
  ((W-1)/W of their padded bytes each time); a lookup receives W-1 copies of the distinct rows
  all ranks read, plus the ids (tests/nn/test_elastic_embedding.py counts them exactly).
- Why the default is False: measured on SmolLM2-135M (tied, vocab 49152 x 576, fp32; 2 gloo
  ranks, budget 0, interleaved; bench/results/2026-12-03_embeddings.md, runs 3 and 4), the
  table in row blocks with the rows-only lookup takes the static tensors per rank from 333.0
  to 279.0 MiB and the tensor peak from 623.8-627.5 to 589.1-596.4 MiB (the whole-table
  design: 861.8; FSDP2: 261.2 static, 635.7 peak): it now beats the replicated table on both
  memory figures. Its speed against the replicated table: 0.843x in one run, 1.052x in the
  other, 0.866x pooled (median of 12 per-round ratios, [0.62, 1.35], 8 of 12 below 1) on a
  VM at load 20-25, with a mechanism behind the loss: the head's blocks are gathered in its
  forward and backward, 402.4 -> 525.0 MiB all-gathered per step (+30%), 57 -> 80
  collectives. Not shown to be within noise, so not switched; nor does it beat FSDP2 on
  static memory (+17.8 MiB: the shards' ragged-chunk padding, 13.1, and the replicated
  adapters, 9.3 against 4.7). Opt-in, for runs that memory binds, not time. At 4 ranks on
  the idle VM (bench/results/2026-12-04_frontier_real.md): 432.7 MiB of tensor peak against
  the replicated table's 513.7 and FSDP2's 500.4, at 0.955x FSDP2's tokens/s (the replicated
  table 1.131x): it moves 788 MiB a step where FSDP2 moves 703, since FSDP2 keeps its root
  module (the tied table) gathered from forward to backward and the runtime gathers the
  head's blocks in both.

[Note: a table in row blocks]
Gathering a whole table for one use (the design before this one) put all of its chunks in
flight at once: on SmolLM2-135M (vocab 49152 x 576, fp32, 108 MiB) 435 pool pages and
coalesced all-gathers of up to 32 MiB per rank with their W-slice receive and packed send
buffers, +238 MiB of tensor peak at budget 0 (bench/results/2026-12-03_embeddings.md, run 2).
So conversion registers a table (and an output layer, tied or not) as several elastic
tensors, its *row blocks*: whole chunks each, at most `ElasticPolicy.table_block_bytes`
bytes (default: the largest unit of the model's other weights, i.e. a decoder layer: on
SmolLM2-135M at the CLI's 256 KiB chunks 8 blocks of 6102 rows and one of 336, each at most
13.5 MiB; a ragged last chunk alone joins the block before it), each its own unit.
The head (`ElasticBlocksLinearFunction`) then uses the blocks one after the other, forward
and backward, in row order, so the runtime gathers, uses and releases them like consecutive
decoder layers and prefetches one ahead (`prefetch_depth`): one use has at most
(1 + prefetch_depth) blocks in flight, which is what the pool's working set already holds
for two decoder layers. Chosen over a cap on one use's bytes inside the runtime: separate
tensors need no change to the runtime's uses, gathers, learned order or prefetch (a block is
a weight like any other, the same machinery the decoder layers are bounded by), where a cap
inside one use would stream a use's chunks against its own prefetch and the learned order's
segments. Arithmetic: the blocks are whole chunks of the table's chunking, and each block's
product is computed chunk by chunk as `ElasticLinearFunction` does, dx accumulated in one
buffer over every chunk in row order, so logits and dx are bit for bit those of the unblocked
chunked head ([Note: chunked compute and bit-exactness] in linear.py: the dense `F.linear`
differs from both in fp32 rounding only); a block held whole (a run) is one GEMM per block.

[Note: a lookup reads only its rows]
A batch reads a few hundred rows of a table of tens of thousands: gathering the table for it
(one use = the whole table's bytes, as the head's) moves about vocab / distinct-ids times
what the lookup needs, and with a tied table a third gather per step. Measured on SmolLM2
(128 random ids per rank, 2 ranks, bench/bench_embedding_lookup.py; 2026-12-03_embeddings.md,
"the lookup"): the rows 590,856 bytes received, 4.1 MiB of tensor growth, against the gathered
table's 56,623,104 bytes and 48.3 MiB, and 29.6x faster (median of 10 interleaved per-round
ratios [10.3, 44.5]). So at budget 0 (the table not kept whole) a lookup is an
exchange of rows outside the pool: (1) the ranks all-gather their id counts and their ids
(padded to the longest: batches may differ in length); (2) every rank takes the distinct ids
of all ranks, U (sorted: the same on every rank), and fills a [|U|, cols] buffer with the
elements of those rows that its shard holds, zeros elsewhere, by the chunk-major layout
([Note: chunk-major shard layout] in elastic_kernels/layout.py: element j of row q of chunk c
is held by rank (q * cols + j) // slice_numel); (3) one all-gather of those buffers, and each
element of each row is taken (`gather`, a copy) from the rank that holds it: no sum, so the
rows are the table's bits (negative zeros included: 0 + -0 would be +0); (4) each rank picks
its own ids' rows. Bytes received per lookup: (W-1) * (8 + 8 * longest batch + |U| * cols *
element size), counted in the runtime's all-gather stats (`count_gather`; per block for the
rows). When every block is held whole (resident runs, budget all) the lookup uses the blocks
(filled once, then O(1)) and reads its rows locally; with the weights in the host store it
reads the rows there; at world size 1 it reads the local shard: none of these communicate.
The layout arithmetic in `_own_rows` is this module's copy of the shard layout: a change of
the layout (e.g. the ragged last chunk's slices) must change it too (the lookup tests compare
bits against the table and would fail).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import all_gather_into
from ..runtime import ElasticTensor, Phase
from .linear import LOW_PRECISION, dequantized_views, keeps_for_backward, no_autocast, op_dtype, refuse_conversion


def can_shard_embedding(module: nn.Module) -> bool:
    """An embedding `convert_to_elastic` may put under the runtime ([Note: embeddings under the
    runtime]): a plain `nn.Embedding` (not a subclass), 2-D, without `max_norm`."""
    return type(module) is nn.Embedding and module.max_norm is None and module.weight.dim() == 2


def table_blocks(rows: int, row_bytes: int, rows_per_chunk: int, limit_bytes: int) -> list[tuple[int, int]]:
    """The row blocks [begin, end) of a table of `rows` rows ([Note: a table in row blocks]):
    whole chunks of `rows_per_chunk` rows each, at most `limit_bytes` per block (at least one
    chunk), the last block the rest; a rest shorter than one chunk (the ragged last chunk
    alone) joins the block before it rather than being a block (and a collective) of its own."""
    if rows < 1 or row_bytes < 1 or rows_per_chunk < 1 or limit_bytes < 1:
        raise ValueError(f"table_blocks: rows {rows}, row_bytes {row_bytes}, rows_per_chunk {rows_per_chunk} and "
                         f"limit_bytes {limit_bytes} must be positive")
    rpc = min(rows_per_chunk, rows)
    per_block = max(1, limit_bytes // (rpc * row_bytes)) * rpc
    blocks = [(r0, min(r0 + per_block, rows)) for r0 in range(0, rows, per_block)]
    if len(blocks) > 1 and blocks[-1][1] - blocks[-1][0] < rpc:
        blocks[-2:] = [(blocks[-2][0], rows)]
    return blocks


def elastic_tensors_of(module: nn.Module) -> tuple[ElasticTensor, ...]:
    """The elastic tensors holding `module`'s frozen weight, in row order: a table's row blocks
    (`ets`), or the one tensor of a linear (`et`); () for any other module."""
    ets = getattr(module, "ets", None)
    if ets is not None:
        return tuple(ets)
    et = getattr(module, "et", None)
    return (et,) if isinstance(et, ElasticTensor) else ()


class _Blocks:
    """What a table's modules share: its row blocks (elastic tensors) and where each begins."""

    def __init__(self, ets, what: str):
        ets = tuple(ets)
        if not ets or not all(isinstance(et, ElasticTensor) for et in ets):
            raise TypeError(f"{what}: expected a non-empty sequence of ElasticTensor row blocks, got {ets!r}")
        first = ets[0]
        for et in ets:
            if len(et.shape) != 2 or et.shape[1] != first.shape[1] or et.dtype != first.dtype \
                    or et.runtime is not first.runtime:
                raise ValueError(f"{what}: the row blocks {[e.name for e in ets]} differ in width, dtype or runtime")
        self.ets = ets
        starts, n = [], 0
        for et in ets:
            starts.append(n)
            n += et.shape[0]
        self.starts = tuple(starts)
        self.rows, self.cols = n, first.shape[1]


class ElasticEmbedding(nn.Module):
    """A frozen embedding whose table is held by the runtime in row blocks (same call as
    `nn.Embedding`; [Note: embeddings under the runtime], [Note: a lookup reads only its rows])."""

    def __init__(self, ets, padding_idx: int | None = None):
        super().__init__()
        if isinstance(ets, ElasticTensor):
            ets = (ets,)
        blocks = _Blocks(ets, "ElasticEmbedding")
        for et in blocks.ets:
            if et.qlayout is not None:
                raise ValueError(f"{et.name}: an embedding table is never quantized ([Note: embeddings under the runtime])")
        self.ets = blocks.ets
        self._starts = blocks.starts
        self.num_embeddings, self.embedding_dim = blocks.rows, blocks.cols
        self.padding_idx = padding_idx

    @property
    def name(self) -> str:
        return self.ets[0].name.rpartition(".rows")[0] or self.ets[0].name

    @torch.compiler.disable  # talks to the runtime: [Note: torch.compile] in linear.py
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first = self.ets[0]
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{self.name}: the input must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{self.name}: token ids must be int64 or int32, got {ids.dtype}")
        if ids.device != first.device:
            raise ValueError(f"{self.name}: token ids are on {ids.device}, the table lives on {first.device}")
        flat = ids.reshape(-1).long()
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(f"{self.name}: token id {lo if lo < 0 else hi} is out of range for an embedding of "
                                 f"{self.num_embeddings} rows")
        with torch.no_grad():
            out = lookup_rows(self.ets, self._starts, self.embedding_dim, flat)
        return out.view(*ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse=True):
        for et in self.ets:
            refuse_conversion(_Probe(et), fn)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, blocks={len(self.ets)}, "
                f"chunks={sum(et.num_chunks for et in self.ets)}, world_size={self.ets[0].layout.world_size}")


class _Probe:
    """`refuse_conversion` reads `module.et`."""

    def __init__(self, et):
        self.et = et


def _own_rows(et: ElasticTensor, rows: torch.Tensor, rank: int, world_size: int):
    """(values, owner) of rows `rows` (of this block) by [Note: chunk-major shard layout]:
    owner[i, j] is the rank whose slice holds element j of row rows[i]; values[i, j] that
    element where this rank owns it, else 0. Reads the shard, or a run's own elements."""
    lay = et.layout
    d, s, rpc = lay.cols, lay.slice_numel, lay.rows_per_chunk
    c = torch.div(rows, rpc, rounding_mode="floor")
    p = (rows - c * rpc).unsqueeze(1) * d + torch.arange(d, device=rows.device)  # element in its chunk
    owner = torch.div(p, s, rounding_mode="floor")
    mine = owner == rank
    o = p - rank * s
    if et.run is not None:  # in the run, chunk c begins at c * W * S and this rank's slice at r * S
        flat, idx = et.run.buffer, (c * world_size * s + rank * s).unsqueeze(1) + o
    elif et.shard is not None:  # chunk-major: slice r of chunk c at c * S of the shard
        flat, idx = et.shard, (c * s).unsqueeze(1) + o
    else:
        raise RuntimeError(f"{et.name}: no shard on this rank")
    idx = torch.where(mine, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
    values = torch.where(mine, flat.take(idx), torch.zeros((), dtype=flat.dtype, device=flat.device))
    return values, owner


def _host_rows(et: ElasticTensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a block kept in the host store (weights_on="host": every rank reads it whole)."""
    out = torch.empty(rows.numel(), et.shape[1], dtype=et.dtype, device=et.device)
    rpc = et.layout.rows_per_chunk
    which = torch.div(rows, rpc, rounding_mode="floor")
    for c in torch.unique(which).tolist():
        sel = (which == c).nonzero().squeeze(1)
        chunk = et.host_chunk(c).to(et.device)
        out.index_copy_(0, sel, chunk.index_select(0, rows.index_select(0, sel) - c * rpc))
    return out


def _by_block(ids: torch.Tensor, starts: tuple[int, ...]):
    """(block, positions in `ids`, rows in that block) for every block some id falls in."""
    bounds = torch.tensor(starts[1:], dtype=torch.int64, device=ids.device)
    block = torch.bucketize(ids, bounds, right=True)
    for k in torch.unique(block).tolist():
        sel = (block == k).nonzero().squeeze(1)
        yield k, sel, ids.index_select(0, sel) - starts[k]


def lookup_rows(ets: tuple[ElasticTensor, ...], starts: tuple[int, ...], cols: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (1-D int64, in range) of the table held in row blocks `ets` beginning at
    `starts`, bit for bit ([Note: a lookup reads only its rows]). A collective of the
    runtime's group unless the table is kept whole (runs) or in the host store."""
    rt = ets[0].runtime
    rt.check_open("lookup")
    w, rank, device = rt.world_size, rt.rank, ets[0].device
    if all(et.run is not None for et in ets):  # kept whole: every block used (filled once), rows read
        out = torch.empty(ids.numel(), cols, dtype=ets[0].dtype, device=device)
        wholes = []
        for et in ets:
            with rt.use(et, Phase.FORWARD, needs_backward=False) as resident:
                wholes.append(resident.whole())
        for k, sel, rows in _by_block(ids, starts):
            out.index_copy_(0, sel, wholes[k].index_select(0, rows))
        return out
    if all(et.shard is None and et.run is None for et in ets):  # weights_on="host"
        out = torch.empty(ids.numel(), cols, dtype=ets[0].dtype, device=device)
        for k, sel, rows in _by_block(ids, starts):
            out.index_copy_(0, sel, _host_rows(ets[k], rows))
        return out
    # 1. every rank's ids (their counts first: batches may differ in length between ranks)
    if w > 1:
        count = torch.tensor([ids.numel()], dtype=torch.int64, device=device)
        counts = torch.empty(w, dtype=torch.int64, device=device)
        all_gather_into(counts, count, rt.group, async_op=False)
        counts_l = counts.tolist()
        width = max(counts_l)
        send = torch.full((width,), -1, dtype=torch.int64, device=device)
        send[: ids.numel()] = ids
        every = torch.empty(w * width, dtype=torch.int64, device=device)
        if width:
            all_gather_into(every, send, rt.group, async_op=False)
        every = every.view(w, width)
        all_ids = torch.cat([every[q, : counts_l[q]] for q in range(w)])
        mine_at = sum(counts_l[:rank])
    else:
        counts_l, width, all_ids, mine_at = [ids.numel()], ids.numel(), ids, 0
    # 2. the rows any rank reads, once each: this rank's elements of them, the owner of each element
    wanted, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
    u = wanted.numel()
    values = torch.zeros(u, cols, dtype=ets[0].dtype, device=device)
    owner = torch.zeros(u, cols, dtype=torch.int64, device=device)
    per_weight = {}
    for k, sel, rows in _by_block(wanted, starts):
        v, o = _own_rows(ets[k], rows, rank, w)
        values.index_copy_(0, sel, v)
        owner.index_copy_(0, sel, o)
        per_weight[ets[k].name] = (w - 1) * sel.numel() * cols * ets[k].element_size
    # 3. one all-gather of those rows; each element taken from its owner (a copy, no sum)
    if w > 1 and u:
        received = torch.empty(w * u * cols, dtype=values.dtype, device=device)
        all_gather_into(received, values.view(-1), rt.group, async_op=False)
        rows = received.view(w, u, cols).gather(0, owner.unsqueeze(0)).squeeze(0)
    else:
        rows = values
    if w > 1:
        rt.count_gather(per_weight if u else {}, other_bytes=(w - 1) * 8 * (1 + width),
                        calls=1 + int(width > 0) + int(u > 0))
    return rows.index_select(0, inverse[mine_at : mine_at + ids.numel()])


class ElasticBlocksLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b over a weight held in row blocks ([Note: a table in row blocks]): each block
    one use of the runtime, in row order, chunk by chunk as in `ElasticLinearFunction`
    (linear.py); backward likewise, dx accumulated over every chunk in row order."""

    @staticmethod
    def forward(ctx, x, bias, ets, starts, dtype, keep_for_backward):
        rt = ets[0].runtime
        out_features = sum(et.shape[0] for et in ets)
        with no_autocast(x.device.type):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            b = None if bias is None else bias.to(dtype)
            y = x2.new_empty(x2.shape[0], out_features)
            for et, base in zip(ets, starts):

                def fwd_chunk(c, w, et=et, base=base):
                    r0, r1 = et.layout.chunk_rows(c)
                    w = dequantized_views(et, [w], dtype, c)[0]
                    y[:, base + r0 : base + r1] = F.linear(x2, w.to(dtype), None if b is None else b[base + r0 : base + r1])

                with rt.use(et, Phase.FORWARD, needs_backward=keep_for_backward) as resident:
                    whole = resident.whole()
                    if whole is not None:
                        end = base + et.shape[0]
                        y[:, base:end] = F.linear(x2, whole.to(dtype), None if b is None else b[base:end])
                    else:
                        resident.execute(fwd_chunk)
        ctx.ets, ctx.starts, ctx.dtype = ets, starts, dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        ets, starts, dtype = ctx.ets, ctx.starts, ctx.dtype
        dx = db = None
        out_features = sum(et.shape[0] for et in ets)
        with no_autocast(dy.device.type):
            dy2 = dy.reshape(-1, out_features).to(dtype)
            if ctx.needs_input_grad[0]:
                low = dtype in LOW_PRECISION
                # As ElasticLinearFunction's chunked dgrad: one accumulator over every chunk in row order.
                acc = torch.zeros(dy2.shape[0], ets[0].shape[1], device=dy2.device,
                                  dtype=torch.float32 if low else dtype)

                def add(rows, w):
                    if low:
                        acc.add_(dy2[:, rows] @ w.to(dtype))
                    else:
                        acc.addmm_(dy2[:, rows], w.to(dtype))

                for et, base in zip(ets, starts):

                    def dgrad_chunk(c, w, et=et, base=base):
                        r0, r1 = et.layout.chunk_rows(c)
                        add(slice(base + r0, base + r1), dequantized_views(et, [w], dtype, c)[0])

                    with et.runtime.use(et, Phase.BACKWARD) as resident:
                        whole = resident.whole()
                        if whole is not None:
                            add(slice(base, base + et.shape[0]), whole)
                        else:
                            resident.execute(dgrad_chunk)
                dx = acc.view(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                db = dy2.sum(0).to(ctx.bias_dtype)
        return dx, db, None, None, None, None


class ElasticBlocksLinear(nn.Module):
    """A frozen output layer whose weight [vocab, hidden] is held by the runtime in row blocks
    (same call as `nn.Linear`; [Note: a table in row blocks]): a tied head shares its
    embedding's blocks (`ets`, one tuple, one copy)."""

    def __init__(self, ets, bias: nn.Parameter | None):
        super().__init__()
        if isinstance(ets, ElasticTensor):
            ets = (ets,)
        blocks = _Blocks(ets, "ElasticBlocksLinear")
        self.ets = blocks.ets
        self._starts = blocks.starts
        self.out_features, self.in_features = blocks.rows, blocks.cols
        self.bias = bias
        self.fan_in_fan_out = False

    @property
    def name(self) -> str:
        return self.ets[0].name.rpartition(".rows")[0] or self.ets[0].name

    @torch.compiler.disable  # [Note: torch.compile] in linear.py
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = op_dtype(x, self.ets[0].dtype, self.name)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        return ElasticBlocksLinearFunction.apply(x, self.bias, self.ets, self._starts, dtype, keeps_for_backward(x))

    def _apply(self, fn, recurse=True):
        for et in self.ets:
            refuse_conversion(_Probe(et), fn)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocks={len(self.ets)}, chunks={sum(et.num_chunks for et in self.ets)}, "
                f"world_size={self.ets[0].layout.world_size}")
