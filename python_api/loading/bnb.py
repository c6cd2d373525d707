"""Reading a checkpoint that transformers saved quantized by bitsandbytes 4-bit (nf4): the
policy's agreement with its `quantization_config` (`packed_format`), the check of each packed
weight's record (`check_packed`), and each weight read from its packed bytes (`BnbNF4Weight`).

[Note: loading a bitsandbytes 4-bit checkpoint]
What transformers 5.23 + bitsandbytes 0.50.2 write (`from_pretrained(quantization_config=
BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...))` then `save_pretrained`,
checked on CPU, where bitsandbytes quantizes with its default pure-torch kernel): config.json
gets `quantization_config` {quant_method: "bitsandbytes", load_in_4bit: true, bnb_4bit_quant_type:
"nf4", bnb_4bit_use_double_quant, bnb_4bit_quant_storage: "uint8", ...} (no block size: the
block is bitsandbytes' default, 64, and is in each weight's record); every Linear but the
modules it skips (lm_head) becomes, for its weight W [out, in] (a GPT-2 Conv1D is stored as
the Linear4bit that replaced it, [out, in] too):

    W                                  uint8 [ceil(numel / 2), 1] (bytes of the storage dtype
                                       when bnb_4bit_quant_storage is not uint8): the NF4 codes
                                       of W flattened row-major, two per byte, first in the high
                                       nibble (an odd numel: the last low nibble is padding)
    W.absmax                           fp32 [ceil(numel / 64)] (the last block partial when 64
                                       does not divide numel); with double quantization uint8 codes
    W.quant_map                        fp32 [16]: the NF4 codebook
    W.nested_absmax                    (double quantization) fp32 [ceil(numel / 64 / 256)]
    W.nested_quant_map                 (double quantization) fp32 [256]: the signed dynamic map
    W.quant_state.bitsandbytes__nf4    uint8: JSON {quant_type, blocksize, dtype, shape, and with
                                       double quantization nested_blocksize: 256, nested_dtype:
                                       "float32", nested_offset: the offset as a float}

How it maps onto the chunk blobs ([Note: quantized chunk blob] in elastic_kernels/quant/blob.py):
bitsandbytes quantizes the flattened weight in blocks of 64 in row-major order, as the blobs
do, and a chunk holds whole rows and whole blocks (rows_per_chunk x in is a multiple of 64:
ElasticPolicy.weight_rows_per_chunk; a 688-wide weight has chunks of a multiple of 4 rows), so
chunk c's codes are bytes [r0 x in / 2, ceil(r1 x in / 2)) of W and its scales are
absmax[r0 x in / 64, ceil(r1 x in / 64)): slices, copied as they are (the last chunk's last
block partial, as the file's). Double quantization is the exception: bitsandbytes quantizes the whole
weight's absmax vector in blocks of 256 with one offset (the mean of all of them), while a
nested chunk blob holds the nested scales of *its own* blocks of 256 scales and one offset.
The offset fits (every chunk stores the weight's); the nested scales fit exactly when every
chunk starts on a block of 256 scales, i.e. rows_per_chunk x in / 64 is a multiple of 256
(or the weight is one chunk): then the chunk's scale codes, its nested scales and the offset
are copied as they are (a 4096-wide weight with chunks of a multiple of 4 rows). Otherwise a
chunk's blocks of 256 would straddle two of bitsandbytes' nested scales, which one nested
scale cannot hold; the weight is then stored without nested scales and each chunk's fp32
scales are computed from the file's, as bitsandbytes computes them when it dequantizes,
fl32(fl32(DYNAMIC_CODE[q] x nested_absmax) + offset): only the scales are dequantized, never
the weights, and the 4-bit codes are never requantized. Either way every dequant impl gives
bitsandbytes' `dequantize_4bit` of the checkpoint bit for bit (tests/quant/test_loading_quant.py).
Each rank copies only the bytes of its own slice of each chunk's blob (the codes and scales of
its rows; in the second case also the few nested scales those scales need).

The checkpoint's settings must be the policy's: `weight_format="nf4"`, `quant_nested` equal to
`bnb_4bit_use_double_quant`, the block size 64 (`quant_block_size` None or 64); a
LoadError names the difference before any tensor is read. Refused as well, naming what was
found: 8-bit bitsandbytes (`load_in_8bit`), fp4, a block size other than 64, another
`quant_method` (GPTQ, AWQ, ...), and the host tier (its store is filled from rows, which would
requantize). Each weight's record and its tiny tensors (codebooks, the sizes of the others) are
checked in `SafetensorsSource.check` before any weight is read.

A packed weight dequantizes to the model's dtype: by default the checkpoint's
`bnb_4bit_compute_dtype` (what its Linear4bit layers compute in, and what transformers'
`from_pretrained` of the checkpoint computes in), else the config's dtype, which is the dtype
transformers recorded for the weights (the records' `dtype`), so the loaded weights are the
checkpoint's `dequantize_4bit` exactly, in that dtype; the model's other floating tensors are cast
to it on load. With `load_elastic(dtype=...)` they dequantize to that dtype directly
(`dequantize_4bit` with its quant_state's dtype set to it): an explicit dtype wins. The weights of the
modules the runtime leaves replicated (below `replicate_below_bytes`) are dequantized once on
load, whole, like any replicated parameter they are read into full precision. The loaded model's
config loses its `quantization_config`: nothing in memory is bitsandbytes-packed, and what
`save_pretrained` writes is full precision (the dequantized weights).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from elastic_kernels import dequantize
from elastic_kernels.quant import DYNAMIC_CODE, NESTED_BLOCK, NF4_CODE, NF4ChunkFormat, QuantizedLayout

from ..quant import PackedRows

BNB_BLOCK = 64  # the only block size read (bitsandbytes' default; transformers sets no other)
QUANT_STATE = ".quant_state.bitsandbytes__"
# Tensors beside a packed weight W, as suffixes of its key (W itself has none).
AUX = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


class PackedFormatError(ValueError):
    """A quantized checkpoint that cannot be read, or a policy that disagrees with it (raised
    as a LoadError by elastic_kernels.api.loading)."""


@dataclass(frozen=True)
class Bnb4bitFormat:
    """The checkpoint's bitsandbytes 4-bit settings, as its quantization_config says."""

    nested: bool
    storage: str  # bnb_4bit_quant_storage: the dtype the codes' bytes are stored as

    def describe(self) -> str:
        return f"bitsandbytes 4-bit nf4, blocksize {BNB_BLOCK}, double quantization {self.nested}"


def _as_dict(qc) -> dict:
    if isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def packed_format(config, policy) -> Bnb4bitFormat | None:
    """The bitsandbytes 4-bit format of a checkpoint whose config is `config` (None: no
    `quantization_config`, a full-precision checkpoint), checked against `policy` ([Note:
    loading a bitsandbytes 4-bit checkpoint]). PackedFormatError naming what was found when the
    checkpoint is quantized in a format that is not read, or when the policy disagrees. Reads
    nothing but the config."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    d = _as_dict(qc)
    method = d.get("quant_method", "unknown")
    found = ", ".join(f"{k}={d[k]!r}" for k in ("quant_method", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
                                               "bnb_4bit_use_double_quant", "bits", "group_size") if k in d)
    readable = (f"load_elastic reads bitsandbytes 4-bit nf4 checkpoints (load_in_4bit, bnb_4bit_quant_type='nf4', "
                f"blocksize {BNB_BLOCK}) and full-precision ones (fp32/bf16/fp16; ElasticPolicy(weight_format=...) "
                f"quantizes those on load)")
    if method != "bitsandbytes":
        raise PackedFormatError(f"the checkpoint is saved quantized by {method!r} (quantization_config: {found}): "
                                f"{readable}")
    if d.get("load_in_8bit") or not d.get("load_in_4bit"):
        raise PackedFormatError(f"the checkpoint is saved quantized by bitsandbytes in 8 bits (quantization_config: "
                                f"{found}): {readable}")
    qtype = d.get("bnb_4bit_quant_type")
    if qtype != "nf4":
        raise PackedFormatError(f"the checkpoint is saved quantized by bitsandbytes 4-bit {qtype!r} (quantization_config: "
                                f"{found}): {readable}")
    nested = bool(d.get("bnb_4bit_use_double_quant", False))
    storage = str(d.get("bnb_4bit_quant_storage", "uint8"))
    if not isinstance(getattr(torch, storage, None), torch.dtype):
        raise PackedFormatError(f"the checkpoint's bnb_4bit_quant_storage={storage!r} is not a torch dtype")
    fmt = Bnb4bitFormat(nested, storage)
    want = f"ElasticPolicy(weight_format='nf4', quant_nested={nested})"
    if policy.weight_format != "nf4":
        raise PackedFormatError(
            f"the checkpoint is saved quantized ({fmt.describe()}) and its packed codes are loaded as they are, "
            f"so the policy must store that format: pass {want}, not weight_format={policy.weight_format!r}")
    if policy.block_size != BNB_BLOCK:
        raise PackedFormatError(
            f"the checkpoint is saved quantized ({fmt.describe()}) but the policy's quant_block_size is "
            f"{policy.block_size}: leave it out (nf4's default is {BNB_BLOCK}) or set {BNB_BLOCK}")
    if policy.quant_nested != nested:
        raise PackedFormatError(
            f"the checkpoint is saved quantized ({fmt.describe()}) but the policy has quant_nested="
            f"{policy.quant_nested}: pass {want}")
    if policy.uses_host_store:
        raise PackedFormatError(
            f"the checkpoint is saved quantized ({fmt.describe()}): loading it into the host tier "
            f"(weights_on={policy.weights_on!r}, host_fraction={policy.host_fraction!r}) is not supported; the "
            f"host store is filled from full-precision rows, which would quantize the weights again")
    return fmt


def compute_dtype(config) -> torch.dtype | None:
    """The `bnb_4bit_compute_dtype` of a bitsandbytes checkpoint's quantization_config (the
    dtype its Linear4bit layers compute in), or None (no quantization_config, none set)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    d = _as_dict(qc).get("bnb_4bit_compute_dtype")
    if isinstance(d, str):
        d = getattr(torch, d.replace("torch.", ""), None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else None


def quant_state_key(base: str) -> str:
    return f"{base}{QUANT_STATE}nf4"


def packed_bases(keys) -> dict[str, str]:
    """{key of a packed weight: the quant-type suffix of its record} for the files' keys."""
    out = {}
    for k in keys:
        i = k.rfind(QUANT_STATE)
        if i > 0:
            out[k[:i]] = k[i + len(QUANT_STATE):]
    return out


def parse_quant_state(raw: torch.Tensor, key: str) -> dict:
    try:
        record = json.loads(bytes(raw.to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackedFormatError(f"{key!r} is not a bitsandbytes quant_state record (JSON): {exc}") from exc
    if not isinstance(record, dict):
        raise PackedFormatError(f"{key!r} is not a bitsandbytes quant_state record: {record!r}")
    return record


def check_packed(base: str, record: dict, entries: dict, small, fmt: Bnb4bitFormat, shape: tuple[int, int],
                 dtype: torch.dtype, allow_cast: bool) -> list[str]:
    """The problems (empty: none) of packed weight `base` of the files against the model's
    weight [out, in] = `shape` of `dtype`: its record, the sizes and dtypes of its tensors,
    its codebooks (`small(key)` reads a tiny tensor whole). `entries`: the files' entries."""
    where = f"{base!r}"
    qtype, block = record.get("quant_type"), record.get("blocksize")
    if qtype != "nf4":
        return [f"{where} is packed as bitsandbytes {qtype!r}; only nf4 is read"]
    if block != BNB_BLOCK:
        return [f"{where} is packed in blocks of {block}; only blocksize {BNB_BLOCK} is read"]
    rec_shape = tuple(record.get("shape") or ())
    if rec_shape != tuple(shape):
        return [f"{where} packs a weight of shape {rec_shape}, the model's is {tuple(shape)} [out, in]"]
    rec_dtype = getattr(torch, str(record.get("dtype")), None)
    if not isinstance(rec_dtype, torch.dtype) or not rec_dtype.is_floating_point:
        return [f"{where}: its record's dtype {record.get('dtype')!r} is not a floating torch dtype"]
    problems = []
    if rec_dtype != dtype and not allow_cast:
        problems.append(f"{where} holds {str(rec_dtype).replace('torch.', '')} weights, the model's are "
                        f"{str(dtype).replace('torch.', '')} (pass dtype= to load_elastic to dequantize them to it)")
    numel = shape[0] * shape[1]
    nb = -(-numel // BNB_BLOCK)  # the last block partial when 64 does not divide numel, as bitsandbytes
    nested = "nested_offset" in record or f"{base}.nested_absmax" in entries
    if nested != fmt.nested:
        problems.append(f"{where} is packed {'with' if nested else 'without'} double quantization, the config's "
                        f"bnb_4bit_use_double_quant is {fmt.nested}")
        return problems
    want = {base: (None, (numel + 1) // 2), f"{base}.absmax": ("U8" if nested else "F32", nb),
            f"{base}.quant_map": ("F32", 16)}
    if nested:
        want[f"{base}.nested_absmax"] = ("F32", -(-nb // NESTED_BLOCK))
        want[f"{base}.nested_quant_map"] = ("F32", 256)
        if record.get("nested_blocksize") != NESTED_BLOCK or record.get("nested_dtype") != "float32":
            problems.append(f"{where}: nested_blocksize {record.get('nested_blocksize')!r} / nested_dtype "
                            f"{record.get('nested_dtype')!r}; read are {NESTED_BLOCK} / 'float32'")
        if not isinstance(record.get("nested_offset"), (int, float)):
            problems.append(f"{where}: its record has no numeric nested_offset")
    for key, (dt, n) in want.items():
        e = entries.get(key)
        if e is None:
            problems.append(f"{key!r} is in none of the files (bitsandbytes writes it with {base!r})")
            continue
        size = 1
        for s in e.shape:
            size *= s
        if key == base:
            if e.dtype is None:
                problems.append(f"{key!r} has dtype {e.dtype_name}, which torch cannot hold")
                continue
            nbytes = size * torch.empty((), dtype=e.dtype).element_size()
            if nbytes != n:
                problems.append(f"{key!r} holds {nbytes} bytes of codes, a [{shape[0]}, {shape[1]}] nf4 weight has {n}")
        elif e.dtype_name != dt or size != n:
            problems.append(f"{key!r} is {e.dtype_name} of {size} elements, expected {dt} of {n}")
    if problems:
        return problems
    for key, code in ((f"{base}.quant_map", NF4_CODE), (f"{base}.nested_quant_map", DYNAMIC_CODE if nested else None)):
        if code is not None and not torch.equal(small(key).reshape(-1).float(), code):
            problems.append(f"{key!r} is not bitsandbytes' {'NF4 codebook' if code is NF4_CODE else 'dynamic map'}")
    return problems


class BnbNF4Weight(PackedRows):
    """One weight of a bitsandbytes 4-bit nf4 checkpoint, read from its file by byte ranges
    ([Note: loading a bitsandbytes 4-bit checkpoint]). `read(key, begin, end)` returns elements
    [begin, end) of the files' tensor `key` along its first dimension (a copy)."""

    def __init__(self, base: str, record: dict, shape: tuple[int, int], read, code_itemsize: int):
        self.base = base
        self.rows_, self.cols = int(shape[0]), int(shape[1])
        self.dtype = getattr(torch, record["dtype"])
        self.nested = "nested_offset" in record
        self.offset = torch.tensor([float(record["nested_offset"])], dtype=torch.float32) if self.nested else None
        self._read = read
        self._itemsize = code_itemsize
        self.nonfinite = 0
        # The byte ranges of the codes the image reader copied from the files (a rank reads
        # those of its own slices only: tests/quant/test_loading_quant.py).
        self.codes_read: list[tuple[int, int]] = []

    def __repr__(self) -> str:
        return f"BnbNF4Weight({self.base!r}, [{self.rows_}, {self.cols}], nested={self.nested})"

    # ------------------------------------------------------------------ file slices

    def _code_bytes(self, begin: int, end: int) -> torch.Tensor:
        """Bytes [begin, end) of the packed codes (whatever the storage dtype)."""
        it = self._itemsize
        e0, e1 = begin // it, -(-end // it)
        raw = self._read(self.base, e0, e1).contiguous().view(torch.uint8).reshape(-1)
        return raw[begin - e0 * it: end - e0 * it]

    def _scales(self, b0: int, b1: int) -> torch.Tensor:
        """The fp32 absmax of blocks [b0, b1) of the weight, as bitsandbytes' dequantize_4bit
        computes them: the stored fp32 values, or with double quantization
        fl32(fl32(DYNAMIC_CODE[q] x nested_absmax[block // 256]) + offset) (two roundings)."""
        if not self.nested:
            return self._read(f"{self.base}.absmax", b0, b1).float()
        q = self._read(f"{self.base}.absmax", b0, b1).long()
        n0, n1 = b0 // NESTED_BLOCK, (b1 - 1) // NESTED_BLOCK + 1
        nested = self._read(f"{self.base}.nested_absmax", n0, n1).float()
        per_block = nested[torch.arange(b0, b1) // NESTED_BLOCK - n0]
        return (DYNAMIC_CODE[q] * per_block) + self.offset

    # ------------------------------------------------------------------ PackedRows

    def __call__(self, b: int, e: int) -> torch.Tensor:
        """Rows [b, e) dequantized to the record's dtype (bitsandbytes' dequantize_4bit)."""
        return self.dequantized(b, e, self.dtype)

    def dequantized(self, b: int, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [b, e) dequantized to `dtype` by the kernels' dequant: a one-row blob without
        nested scales holding the codes and fp32 scales of the blocks those rows touch (blocks
        run over the flattened weight, so rows may start and end mid-block), then sliced."""
        cols, numel = self.cols, self.rows_ * self.cols
        k0, k1 = b * cols // BNB_BLOCK, -(-(e * cols) // BNB_BLOCK)
        w0, w1 = k0 * BNB_BLOCK, min(k1 * BNB_BLOCK, numel)
        codes = self._code_bytes(w0 // 2, (w1 + 1) // 2)
        scales = self._scales(k0, k1)
        blob = torch.cat([codes, scales.contiguous().view(torch.uint8)])
        flat = dequantize(blob, NF4ChunkFormat(1, w1 - w0, BNB_BLOCK, False), 1, dtype=dtype).reshape(-1)
        return flat[b * cols - w0: e * cols - w0].reshape(e - b, cols)

    def aligned(self, rows_per_chunk: int) -> bool:
        """Whether every chunk starts on one of bitsandbytes' blocks of 256 scales, so that the
        chunks' nested blobs hold its nested scales exactly."""
        return rows_per_chunk >= self.rows_ or (rows_per_chunk * self.cols // BNB_BLOCK) % NESTED_BLOCK == 0

    def layout(self, policy, name: str, shape, rows_per_chunk: int) -> QuantizedLayout:
        if policy.weight_format != "nf4" or policy.block_size != BNB_BLOCK or policy.quant_nested != self.nested:
            raise ValueError(f"{name}: the file holds it as {BNB_BLOCK}-blocks nf4 (double quantization "
                             f"{self.nested}), the policy stores weight_format={policy.weight_format!r}, block "
                             f"{policy.block_size}, quant_nested={policy.quant_nested}")
        rpc = min(rows_per_chunk, self.rows_)
        nested = self.nested and self.aligned(rpc)
        return QuantizedLayout(self.rows_, self.cols, rpc, "nf4", BNB_BLOCK, nested)

    def image_reader(self, qlayout: QuantizedLayout, device):
        """`read(b, e)`: bytes [b, e) of the image, within one chunk's blob, copied from the
        file: the codes and scales of those bytes only (with the fp32 fallback of [Note: loading
        a bitsandbytes 4-bit checkpoint], the scales computed from the file's, and their nested
        scales)."""
        formats = qlayout.formats
        cols, rpc = self.cols, qlayout.rows_per_chunk
        self.nonfinite = 0

        numel = self.rows_ * cols

        def count(scales: torch.Tensor, b0: int) -> None:
            """Add the weights of blocks b0, b0 + 1, ... whose scale is not finite (the
            weight's last block may be partial)."""
            bad = (~torch.isfinite(scales)).nonzero().reshape(-1) + b0
            self.nonfinite += int(torch.clamp(numel - bad * BNB_BLOCK, max=BNB_BLOCK).sum())

        def read(b: int, e: int) -> torch.Tensor:
            c, lo, hi = qlayout.blob_span(b, e)
            fmt = formats[c]
            first_el = c * rpc * cols  # the chunk's first weight
            first_block = first_el // BNB_BLOCK
            out = torch.empty(hi - lo, dtype=torch.uint8)

            def section(off: int, size: int, fill) -> None:
                a, z = max(lo, off), min(hi, off + size)
                if a < z:
                    out[a - lo: z - lo] = fill(a - off, z - off)

            def codes(a: int, z: int) -> torch.Tensor:
                self.codes_read.append((first_el // 2 + a, first_el // 2 + z))
                return self._code_bytes(first_el // 2 + a, first_el // 2 + z)

            def fp32_scales(a: int, z: int) -> torch.Tensor:
                k0, k1 = a // 4, -(-z // 4)
                s = self._scales(first_block + k0, first_block + k1)
                skip = 1 if a % 4 else 0  # a scale is counted by the slice holding its first byte
                count(s[skip:], first_block + k0 + skip)
                return s.contiguous().view(torch.uint8)[a - 4 * k0: z - 4 * k0]

            def scale_codes(a: int, z: int) -> torch.Tensor:
                count(self._scales(first_block + a, first_block + z), first_block + a)
                return self._read(f"{self.base}.absmax", first_block + a, first_block + z).to(torch.uint8)

            def nested_scales(a: int, z: int) -> torch.Tensor:
                j0, j1 = a // 4, -(-z // 4)
                n0 = first_block // NESTED_BLOCK
                s = self._read(f"{self.base}.nested_absmax", n0 + j0, n0 + j1).float()
                return s.contiguous().view(torch.uint8)[a - 4 * j0: z - 4 * j0]

            def offset(a: int, z: int) -> torch.Tensor:
                return self.offset.view(torch.uint8)[a:z]

            section(fmt.codes_offset, fmt.codes_bytes, codes)
            section(fmt.scales_offset, fmt.scales_bytes, scale_codes if fmt.nested else fp32_scales)
            if fmt.nested:
                section(fmt.nested_scales_offset, fmt.nested_scales_bytes, nested_scales)
                section(fmt.offset_offset, fmt.offset_bytes, offset)
            return out.to(device)

        return read


def read_slices(path: str, files_of):
    """`read(key, begin, end)`: elements [begin, end) along the first dimension of the files'
    tensor `key` (`files_of(key)` names its file in directory `path`), a copy of its own (each
    read opens the file and closes it: [Note: memory-mapped reads and the resident set])."""
    from safetensors import safe_open

    def read(key: str, begin: int, end: int) -> torch.Tensor:
        with safe_open(os.path.join(path, files_of(key)), framework="pt") as f:
            return f.get_slice(key)[begin:end].clone()

    return read
