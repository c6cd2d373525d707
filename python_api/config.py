"""Policy objects: frozen dataclasses passed explicitly (no global configuration)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# PagePool pages are multiples of 512 bytes (kPageAlign, csrc/pool/page_pool.cpp, checks it).
# The one Python definition: the policy checks, the runtime's page size, the host store's layout
# and the planner's models all read it here.
PAGE_ALIGN = 512
# The activation offload's smallest host buffer (and smallest non-zero host budget): one page
# alignment ([Note: activation offload] in python_api/host/offload.py).
MIN_HOST_BUFFER_BYTES = PAGE_ALIGN
# The longest collective timeout accepted: 30 days. datetime.timedelta (what the process group
# takes) overflows near 1e14 s, and a timeout of months is a hang in all but name.
_MAX_TIMEOUT_S = 30 * 24 * 3600.0
# The weight formats of quantized frozen chunks and their block sizes, as the kernels layer
# defines them (elastic_kernels/quant: FORMATS, default_block_size, check_block). Repeated here
# because this module stays torch-free (the planner imports it); tests/quant/test_policy.py
# checks that the two agree.
WEIGHT_FORMATS = ("nf4", "int8")
DEFAULT_QUANT_BLOCK = {"nf4": 64, "int8": 256}
MIN_QUANT_BLOCK, MAX_QUANT_BLOCK = 32, 4096


def quant_rows_multiple(cols: int, block: int) -> int:
    """The fewest rows of `cols` weights that hold whole quantization blocks of `block`:
    block / gcd(cols, block) (elastic_kernels.quant.rows_multiple, repeated torch-free)."""
    return block // math.gcd(cols, block)


def quant_rows_per_chunk(rows_per_chunk: int, rows: int, cols: int, block: int) -> int:
    """`rows_per_chunk` rounded so that a chunk holds whole blocks ([Note: quantized chunk
    blob] in elastic_kernels/quant/blob.py): down to a multiple of `quant_rows_multiple`, or up
    to one multiple when fewer rows fit (a chunk then exceeds chunk_bytes by under that many
    rows), at most the weight's rows (one chunk: its last block may be partial)."""
    m = quant_rows_multiple(cols, block)
    return min(rows, max(m, rows_per_chunk - rows_per_chunk % m))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ratio(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"ElasticPolicy.{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"ElasticPolicy.{name} must be in [0, 1], got {value}")


def check_host_budget(host_budget_bytes) -> None:
    """A host budget must be None (no cap), 0 (nothing offloaded) or at least one buffer of the
    smallest class; anything in between cannot hold a single activation and is refused."""
    if host_budget_bytes is not None and 0 < host_budget_bytes < MIN_HOST_BUFFER_BYTES:
        raise ValueError(
            f"ElasticPolicy.host_budget_bytes={host_budget_bytes} is smaller than one host buffer "
            f"({MIN_HOST_BUFFER_BYTES} bytes): no activation could ever be offloaded; use 0 to offload "
            f"nothing, None for no cap, or at least {MIN_HOST_BUFFER_BYTES}"
        )


@dataclass(frozen=True)
class ElasticPolicy:
    """The knobs of the elastic frozen-weight runtime.

    chunk_bytes        target size of one chunk of a frozen weight (rounded down to whole rows;
                       a chunk is the unit of residency, communication and GEMM).
    keep_ratio         fraction of each weight's chunks kept from forward to backward (PEAK or
                       PERSISTENT); the rest are TRANSIENT: gathered for each use.
    persist_ratio      fraction of each weight's chunks kept across iterations (PERSISTENT);
                       persist_ratio <= keep_ratio. See [Note: residency classes] in
                       python_api/runtime/tensor.py for which chunks get which class.
    pool_budget_bytes  device bytes for chunks kept beyond their use (the cache); None means
                       enough for every frozen chunk. The runtime adds its working set (the
                       layers in flight) on top; see [Note: pool budget and working set].
    prefetch_depth     layers gathered ahead of the one running, forward and backward.
    resident_runs      hold a weight every chunk of which is kept across iterations as one
                       tensor, its shard in place, one GEMM per use (default True); False keeps
                       it in pool pages beside its shard. See [Note: resident runs] in
                       python_api/runtime/tensor.py.
    page_bytes         pool page size; default: the largest real chunk of the wrapped weights
                       rounded up to 512 bytes. A chunk larger than a page is an error.
    collective_bytes   coalescing cap: missing chunks of a layer are gathered in collectives of
                       at most this many bytes per rank (at least one chunk each); None means
                       one collective per layer. See NOTES.md for the measurement behind the
                       default.
    collective_timeout_s  how long a rank waits for one all-gather before failing with an
                       error naming the layer (a peer that died must not hang the job);
                       None uses the process group's timeout. Host-waited (gloo) gathers
                       only: on NCCL the process group's timeout bounds a hang (see
                       python_api/distributed/collectives.py).
    all_reduce_grads   average the gradients of trainable (replicated) parameters across the
                       group once per backward.
    grad_bucket_bytes  gradients are averaged in buckets of at most this many bytes, each
                       all-reduced asynchronously as soon as its gradients are ready in
                       backward and waited for at the end of backward (DDP's reducer); None:
                       one bucket per dtype. See [Note: gradient buckets] in
                       python_api/runtime/_grads.py.
    replicate_below_bytes  convert_to_elastic keeps frozen non-target linears and embeddings
                       smaller than this replicated (sharding them would cost more collectives
                       than memory).
    shard_embeddings   True: convert_to_elastic puts the model's `nn.Embedding` tables and its
                       output layer under the runtime, in row blocks (sharded and cached like
                       the linears; a tied output layer shares the table's blocks; a lookup
                       exchanges only the rows it reads). False (default): they, and a linear
                       tied to one, stay replicated: on SmolLM2-135M at budget 0 sharding
                       lowers static memory by 54 MiB and the tensor peak by 27-38 MiB per
                       rank at 2 ranks, 81 MiB at 4 (below FSDP2's: 432.7 vs 500.4 MiB), but
                       moves 30% more all-gather bytes a step (0.87x the replicated table's
                       tokens/s, pooled over two runs at 2 ranks; 0.85x at 4 ranks,
                       bench/results/2026-12-04_frontier_real.md). See [Note: embeddings under
                       the runtime] in python_api/nn/embedding.py.
    table_block_bytes  with shard_embeddings, the most bytes of one row block of a table or
                       output layer (each block its own unit, gathered, used and released in
                       turn); None: the largest unit of the other weights (a decoder layer).
                       See [Note: a table in row blocks] in python_api/nn/embedding.py.
    weights_on         where the source of truth of the frozen weights lives: "device" (each
                       rank keeps its shard on the device) or "host" (one whole copy per node in
                       shared host memory, the host store; no device shard at all: every chunk
                       the pool misses is copied host -> page). See [Note: chunk sources] in
                       python_api/host/sources.py.
    host_fraction      the share of missing chunks filled from the host store rather than from
                       peers (both in flight together); None: 0 with weights_on="device", 1 with
                       "host" (the only value allowed there). Any value > 0 builds the host store.
    offload_activations  move the tensors the elastic LoRA layers save for backward to host
                       memory after their forward and bring them back one layer ahead of their
                       backward (python_api/host/offload.py).
    host_budget_bytes  host bytes the host tier may take beyond the store (the recycled
                       activation buffers); past it activations stay on the device. None: no cap.
    host_setup_timeout_s  how long the host store's set-up may take (creating and zeroing the
                       segment, every rank's pin and fill) before every rank fails with an error
                       naming the slow stage and ranks; None: scaled with the store's size,
                       collective_timeout_s + 1 s per 256 MiB. See [Note: the set-up's own time
                       bound] in python_api/host/store.py.
    weight_format      how the frozen weights under the runtime are stored: None (as they are,
                       today's behaviour), "nf4" (QLoRA's NF4, bitsandbytes' bit for bit) or
                       "int8" (blockwise symmetric absmax int8). A quantized weight is quantized
                       once when it is registered and lives quantized in the shard, the pool's
                       pages, the all-gathers, the host store and the host -> page copies;
                       each use dequantizes it into the compute dtype right before the GEMM
                       ([Note: quantized frozen weights] in python_api/quant/__init__.py). It
                       changes the model's numerics: the user's choice, never the planner's.
    quant_block_size   weights per quantization block (a power of two in [32, 4096]; blocks run
                       over each weight flattened, as bitsandbytes', so any row length is
                       stored); None: the format's default (nf4 64,
                       as bitsandbytes; int8 256, [Note: int8 block size] in
                       elastic_kernels/quant/int8.py). Only with a weight_format.
    quant_nested       nf4 only: double quantization of the scales (bitsandbytes'
                       bnb_4bit_use_double_quant: 8-bit scale codes, fp32 per 256 of them).
    quant_skip_modules with a weight_format, the modules whose weights stay in full precision
                       (bitsandbytes' llm_int8_skip_modules): None (default) the model's output
                       layer, as bitsandbytes, PEFT and torchtune keep it; a tuple of module
                       names (a name matches that module, any module whose dotted name ends
                       with it, and the modules inside it: "lm_head", "mlp.down_proj",
                       "model.layers.0"); () quantizes every weight under the runtime. See
                       [Note: what QLoRA keeps in full precision] in python_api/nn/convert.py.
    """

    chunk_bytes: int = 4 << 20
    keep_ratio: float = 1.0
    persist_ratio: float = 1.0
    pool_budget_bytes: int | None = None
    prefetch_depth: int = 1
    resident_runs: bool = True
    page_bytes: int | None = None
    collective_bytes: int | None = 32 << 20
    collective_timeout_s: float | None = 300.0
    all_reduce_grads: bool = True
    grad_bucket_bytes: int | None = 1 << 20
    replicate_below_bytes: int = 1 << 20
    shard_embeddings: bool = False
    table_block_bytes: int | None = None
    weights_on: str = "device"
    host_fraction: float | None = None
    offload_activations: bool = False
    host_budget_bytes: int | None = None
    host_setup_timeout_s: float | None = None
    weight_format: str | None = None
    quant_block_size: int | None = None
    quant_nested: bool = False
    quant_skip_modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if not _is_int(self.chunk_bytes) or self.chunk_bytes <= 0:
            raise ValueError(f"ElasticPolicy.chunk_bytes must be a positive int, got {self.chunk_bytes!r}")
        _check_ratio("keep_ratio", self.keep_ratio)
        _check_ratio("persist_ratio", self.persist_ratio)
        if self.keep_ratio < self.persist_ratio:
            raise ValueError(
                f"ElasticPolicy: keep_ratio ({self.keep_ratio}) must be >= persist_ratio ({self.persist_ratio}): "
                "a chunk kept across iterations is also kept from forward to backward"
            )
        if self.pool_budget_bytes is not None and (not _is_int(self.pool_budget_bytes) or self.pool_budget_bytes < 0):
            raise ValueError(f"ElasticPolicy.pool_budget_bytes must be None or an int >= 0, got {self.pool_budget_bytes!r}")
        if not _is_int(self.prefetch_depth) or self.prefetch_depth < 0:
            raise ValueError(f"ElasticPolicy.prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}")
        if self.page_bytes is not None:
            if not _is_int(self.page_bytes) or self.page_bytes <= 0 or self.page_bytes % PAGE_ALIGN:
                raise ValueError(
                    f"ElasticPolicy.page_bytes must be a positive multiple of {PAGE_ALIGN}, got {self.page_bytes!r}"
                )
            if self.chunk_bytes > self.page_bytes:
                raise ValueError(
                    f"ElasticPolicy.chunk_bytes ({self.chunk_bytes}) is larger than the pool page "
                    f"(page_bytes={self.page_bytes}): a chunk must fit in one page"
                )
        if self.collective_bytes is not None and (not _is_int(self.collective_bytes) or self.collective_bytes <= 0):
            raise ValueError(f"ElasticPolicy.collective_bytes must be None or a positive int, got {self.collective_bytes!r}")
        if self.table_block_bytes is not None and (not _is_int(self.table_block_bytes) or self.table_block_bytes <= 0):
            raise ValueError(f"ElasticPolicy.table_block_bytes must be None or a positive int, got {self.table_block_bytes!r}")
        if not isinstance(self.shard_embeddings, bool):
            raise ValueError(f"ElasticPolicy.shard_embeddings must be True or False, got {self.shard_embeddings!r}")
        if not _is_int(self.replicate_below_bytes) or self.replicate_below_bytes < 0:
            raise ValueError(f"ElasticPolicy.replicate_below_bytes must be an int >= 0, got {self.replicate_below_bytes!r}")
        t = self.collective_timeout_s
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= _MAX_TIMEOUT_S
        ):
            raise ValueError(
                f"ElasticPolicy.collective_timeout_s must be None or a number of seconds in (0, {_MAX_TIMEOUT_S:.0f}] "
                f"(30 days), got {t!r}"
            )
        t = self.host_setup_timeout_s
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= _MAX_TIMEOUT_S
        ):
            raise ValueError(
                f"ElasticPolicy.host_setup_timeout_s must be None or a number of seconds in (0, {_MAX_TIMEOUT_S:.0f}] "
                f"(30 days), got {t!r}"
            )
        if self.grad_bucket_bytes is not None and (not _is_int(self.grad_bucket_bytes) or self.grad_bucket_bytes <= 0):
            raise ValueError(f"ElasticPolicy.grad_bucket_bytes must be None or a positive int, got {self.grad_bucket_bytes!r}")
        if not isinstance(self.resident_runs, bool):
            raise ValueError(f"ElasticPolicy.resident_runs must be True or False, got {self.resident_runs!r}")
        if not isinstance(self.all_reduce_grads, bool):
            raise ValueError(f"ElasticPolicy.all_reduce_grads must be True or False, got {self.all_reduce_grads!r}")
        if self.weights_on not in ("device", "host"):
            raise ValueError(f'ElasticPolicy.weights_on must be "device" or "host", got {self.weights_on!r}')
        if self.host_fraction is not None:
            _check_ratio("host_fraction", self.host_fraction)
            if self.weights_on == "host" and self.host_fraction != 1:
                raise ValueError(
                    f'ElasticPolicy: with weights_on="host" there is no device shard to gather from, so every '
                    f"missing chunk comes from the host store: host_fraction must be 1 or None, got {self.host_fraction}"
                )
        if not isinstance(self.offload_activations, bool):
            raise ValueError(f"ElasticPolicy.offload_activations must be True or False, got {self.offload_activations!r}")
        if self.host_budget_bytes is not None and (not _is_int(self.host_budget_bytes) or self.host_budget_bytes < 0):
            raise ValueError(f"ElasticPolicy.host_budget_bytes must be None or an int >= 0, got {self.host_budget_bytes!r}")
        if self.offload_activations:
            check_host_budget(self.host_budget_bytes)
        self._check_weight_format()

    def _check_weight_format(self) -> None:
        fmt = self.weight_format
        if fmt is not None and fmt not in WEIGHT_FORMATS:
            raise ValueError(f"ElasticPolicy.weight_format must be None or one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
        if not isinstance(self.quant_nested, bool):
            raise ValueError(f"ElasticPolicy.quant_nested must be True or False, got {self.quant_nested!r}")
        skip = self.quant_skip_modules
        if skip is not None:
            if isinstance(skip, str) or not isinstance(skip, (tuple, list)) \
                    or not all(isinstance(n, str) and n and n.strip(".") == n for n in skip):
                raise ValueError(f"ElasticPolicy.quant_skip_modules must be None or a list of module names (e.g. "
                                 f"['lm_head']; [] quantizes every weight), got {skip!r}")
            object.__setattr__(self, "quant_skip_modules", tuple(skip))  # frozen: hashable, as given
        b = self.quant_block_size
        if fmt is None:
            if b is not None or self.quant_nested:
                raise ValueError(
                    f"ElasticPolicy: quant_block_size={b!r} / quant_nested={self.quant_nested!r} set without a "
                    f"weight_format: they describe a quantized format (weight_format='nf4' or 'int8')")
            return
        if b is not None and (not _is_int(b) or not (MIN_QUANT_BLOCK <= b <= MAX_QUANT_BLOCK and b & (b - 1) == 0)):
            raise ValueError(
                f"ElasticPolicy.quant_block_size must be None or a power of two in [{MIN_QUANT_BLOCK}, {MAX_QUANT_BLOCK}], got {b!r}")
        if self.quant_nested and fmt != "nf4":
            raise ValueError(
                f"ElasticPolicy.quant_nested is an nf4 option (double quantization of its scales); "
                f"weight_format={fmt!r} has no nested scales")

    @property
    def block_size(self) -> int | None:
        """The quantization block in force (None without a weight_format)."""
        if self.weight_format is None:
            return None
        return self.quant_block_size if self.quant_block_size is not None else DEFAULT_QUANT_BLOCK[self.weight_format]

    @property
    def source_fraction(self) -> float:
        """The effective host_fraction (None resolved by weights_on)."""
        if self.host_fraction is not None:
            return float(self.host_fraction)
        return 1.0 if self.weights_on == "host" else 0.0

    @property
    def uses_host_store(self) -> bool:
        return self.weights_on == "host" or self.source_fraction > 0

    def rows_per_chunk(self, row_bytes: int, what: str = "weight") -> int:
        """Whole rows per chunk for rows of `row_bytes` bytes."""
        if row_bytes > self.chunk_bytes:
            raise ValueError(
                f"ElasticPolicy.chunk_bytes ({self.chunk_bytes}) is smaller than one row of {what} "
                f"({row_bytes} bytes): a chunk holds whole rows"
            )
        return self.chunk_bytes // row_bytes

    def quantizes(self, name: str) -> bool:
        """Whether the weight of module `name` is stored in the weight_format: not without one,
        not when `quant_skip_modules` matches it (None: the module named lm_head; conversion
        replaces None by the model's own output layer)."""
        if self.weight_format is None:
            return False
        skip = ("lm_head",) if self.quant_skip_modules is None else self.quant_skip_modules
        padded = f".{name}."  # whole components only: "lm_head" is not "lm_head_2"
        return not any(f".{key}." in padded for key in skip)

    def weight_rows_per_chunk(self, name: str, shape, row_bytes: int) -> int:
        """Whole rows per chunk of weight `name` of `shape` whose rows are `row_bytes` bytes:
        `rows_per_chunk`, rounded for a weight this policy quantizes so that every chunk but
        the last holds whole blocks (`quant_rows_per_chunk`: a multiple of block / gcd(row
        length, block) rows, 4 rows of 688 for block 64; unchanged when the block divides the
        row)."""
        rpc = self.rows_per_chunk(row_bytes, name)
        shape = tuple(int(d) for d in shape)
        if len(shape) != 2 or not self.quantizes(name):
            return rpc
        return quant_rows_per_chunk(rpc, shape[0], shape[1], self.block_size)

    def check_quantizable(self, name: str, shape) -> None:
        """Raise, naming the weight and its shape, unless a weight of `shape` can be stored in
        this policy's weight_format: a 2-D weight [out, in], of any row length (blocks run over
        the flattened weight, as bitsandbytes'). Nothing to check for a weight the policy does
        not quantize (`quantizes`)."""
        if not self.quantizes(name):
            return
        shape = tuple(int(d) for d in shape)
        if len(shape) != 2:
            raise ValueError(
                f"{name}: weight_format={self.weight_format!r} stores 2-D weights [out, in] in blocks of rows; "
                f"this weight has shape {shape}")
