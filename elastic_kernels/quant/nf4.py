"""NF4, QLoRA's 4-bit NormalFloat, exactly as bitsandbytes defines it (0.50.2).

Values: 16 quantiles of N(0, 1) scaled to [-1, 1] (``NF4_CODE``, bitsandbytes'
``get_4bit_type("nf4")``); blocks of ``block_size`` consecutive weights (64 by default) share one
fp32 absmax (blocks run over the chunk's weights flattened row-major; the last block is partial
when the block does not divide the chunk's weights, its absmax over its own weights, as
bitsandbytes does); weight w of a block with absmax a gets the code of the nearest value to w / a (ties
by bitsandbytes' midpoint rule) and dequantizes to ``fl32(NF4_CODE[code] * a)``, then rounded
to the compute dtype (round to nearest even). Two codes per byte, the first element in the HIGH
nibble (bitsandbytes' order); an odd number of weights ends in a byte whose low nibble is the
code of 0.0 (7), bitsandbytes' padding.

Double quantization (bitsandbytes' ``compress_statistics=True``, transformers'
``bnb_4bit_use_double_quant``): the chunk's absmax values minus their mean (the *offset*, fp32)
are quantized in blocks of 256 to 8 bits with bitsandbytes' signed dynamic map
(``DYNAMIC_CODE``) and one fp32 absmax per block of 256 (the *nested scales*); a block's absmax
is then ``fl32(fl32(DYNAMIC_CODE[q] * absmax2) + offset)`` (two roundings, no FMA).

Bit for bit with bitsandbytes on CPU (tests/kernels/test_quant.py): ``quantize_nf4`` gives the
codes and scales of ``bitsandbytes.functional.quantize_4bit(w, blocksize=block_size,
quant_type="nf4", compress_statistics=nested)`` applied to the chunk's rows (its pure-torch
default kernel for the codes; for the nested scales, its C++ ``quantize_blockwise``, whose
65536-entry look-up table and fused multiply-add are restated below), and every dequant impl
gives its ``dequantize_4bit``. On another device the same torch ops run; the offset is then
that device's mean.

Where the blob's bytes are: ``NF4ChunkFormat`` and blob.py [Note: quantized chunk blob].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_kernels.quant._common import as_bytes, check_blob, check_block, check_weight, f32_copy

NF4_DEFAULT_BLOCK = 64
NESTED_BLOCK = 256  # scales per nested block (bitsandbytes quantizes the absmax with blocksize=256)

# bitsandbytes' NF4 table (functional.get_4bit_type("nf4"); the same literals as its C++).
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)


def _dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed=True)``: the same operations in the same order
    (fp32 linspace, Python-float scaling, sorted), so the same 256 fp32 values."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:  # (none for 8 bits and 7 exponent bits; kept to mirror the source)
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data += [0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


DYNAMIC_CODE = _dynamic_map()


def _dynamic_lut(code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU ``build_quantize_lut``: entry i is the code index of the normalised value
    fl32(-1 + fl32(2i / 65535)), i.e. how many midpoints fl32(0.5 * fl32(c_j + c_j+1)) are below it."""
    midpoints = 0.5 * (code[:-1] + code[1:])
    i = torch.arange(65536, dtype=torch.float32)
    val = -1.0 + (2.0 * i) / torch.full_like(i, 65535.0)
    return torch.searchsorted(midpoints, val, right=False).to(torch.uint8)


_DYNAMIC_LUT = _dynamic_lut(DYNAMIC_CODE)
_NF4_BOUNDS = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2  # bitsandbytes' _get_4bit_quantize_bounds (NF4 is sorted)
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def table(name: str, device: torch.device | str) -> torch.Tensor:
    """A codebook ("nf4", "dynamic") or look-up table ("dynamic_lut", "nf4_bounds") on ``device``
    (cached: the kernels read it on every call)."""
    device = torch.device(device)
    key = (name, device)
    t = _TABLES.get(key)
    if t is None:
        src = {"nf4": NF4_CODE, "dynamic": DYNAMIC_CODE, "dynamic_lut": _DYNAMIC_LUT, "nf4_bounds": _NF4_BOUNDS}[name]
        t = _TABLES[key] = src.to(device)
    return t


@dataclass(frozen=True)
class NF4ChunkFormat:
    """The blob of one NF4 chunk of ``rows`` x ``cols`` weights ([Note: quantized chunk blob]).

    Any shape: blocks of ``block_size`` (a power of two in [32, 4096], default 64) run over the
    weights flattened row-major, the last one partial when the block does not divide
    rows x cols. Byte sections, in order: codes (ceil(numel / 2)), then scales (fp32 per
    block; with ``nested``, one uint8 code per block), then with ``nested`` the nested scales
    (fp32 per 256 scales) and the offset (one fp32).
    """

    rows: int
    cols: int
    block_size: int = NF4_DEFAULT_BLOCK
    nested: bool = False

    name = "nf4"

    def __post_init__(self):
        check_block("nf4", self.rows, self.cols, self.block_size)
        if not isinstance(self.nested, bool):
            raise TypeError(f"nf4: nested must be a bool, got {type(self.nested).__name__}")

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def num_blocks(self) -> int:
        """Blocks, the last one partial when block_size does not divide numel."""
        return -(-self.numel // self.block_size)

    @property
    def nested_blocks(self) -> int:
        return -(-self.num_blocks // NESTED_BLOCK) if self.nested else 0

    @property
    def codes_offset(self) -> int:
        return 0

    @property
    def codes_bytes(self) -> int:
        return (self.numel + 1) // 2

    @property
    def scales_offset(self) -> int:
        return self.codes_bytes

    @property
    def scales_bytes(self) -> int:
        return self.num_blocks * (1 if self.nested else 4)

    @property
    def nested_scales_offset(self) -> int:
        return self.scales_offset + self.scales_bytes

    @property
    def nested_scales_bytes(self) -> int:
        return 4 * self.nested_blocks

    @property
    def offset_offset(self) -> int:
        return self.nested_scales_offset + self.nested_scales_bytes

    @property
    def offset_bytes(self) -> int:
        return 4 if self.nested else 0

    @property
    def total_bytes(self) -> int:
        return self.offset_offset + self.offset_bytes

    def fp32_sections_aligned(self) -> bool:
        """Whether every fp32 section starts at a multiple of 4 bytes from the blob's start."""
        if self.nested:
            return self.nested_scales_offset % 4 == 0  # the offset follows whole fp32s
        return self.scales_offset % 4 == 0

    def with_rows(self, rows: int) -> NF4ChunkFormat:
        return NF4ChunkFormat(rows, self.cols, self.block_size, self.nested)

    def split(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sections of ``blob`` (copies of the fp32 ones, which may be unaligned):
        ``codes`` (uint8, packed), ``scales`` (fp32 absmax, or uint8 codes when nested) and, when
        nested, ``nested_scales`` (fp32) and ``offset`` (fp32, 0-d)."""
        check_blob(blob, self)
        out = {"codes": blob[: self.codes_bytes]}
        sc = blob[self.scales_offset : self.scales_offset + self.scales_bytes]
        out["scales"] = sc if self.nested else f32_copy(sc)
        if self.nested:
            out["nested_scales"] = f32_copy(blob[self.nested_scales_offset : self.offset_offset])
            out["offset"] = f32_copy(blob[self.offset_offset : self.total_bytes]).reshape(())
        return out


def quantize_blockwise_dynamic(x: torch.Tensor, block_size: int = NESTED_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 absmax per block) of fp32 ``x`` (1-D) with the dynamic map, as
    bitsandbytes' CPU ``quantize_blockwise`` (csrc/cpu_ops.cpp ``quantize_cpu_impl``): per block,
    absmax a = max |x|, v = clamp(fl32(x * fl32(1 / a)), -1, 1), look-up index
    trunc(fma32((v + 1) * 0.5, 65535, 0.5)) (a single rounding: its compiled code is an FMA;
    computed here in float64, where it is exact, then rounded once to fp32), code = LUT[index];
    a block with a == 0 gets code 0."""
    n = x.numel()
    nb = -(-n // block_size)
    padded = torch.nn.functional.pad(x.reshape(-1), (0, nb * block_size - n)).view(nb, block_size)
    absmax = padded.abs().amax(dim=1)
    inv = 1.0 / absmax  # a true fp32 division (torch's reciprocal), like `1.0f / absmax_block`
    v = torch.clamp(padded * inv[:, None], -1.0, 1.0)
    t = (v + 1.0) * 0.5  # exact: fl32(v + 1) is a multiple of 2^-24, so t * 65535 + 0.5 fits float64
    index = (t.double() * 65535.0 + 0.5).float().to(torch.int64) & 0xFFFF
    codes = table("dynamic_lut", x.device)[index]
    codes = torch.where(absmax[:, None] == 0, torch.zeros_like(codes), codes)
    return codes.reshape(-1)[:n], absmax


def quantize_nf4(w: torch.Tensor, *, block_size: int = NF4_DEFAULT_BLOCK, nested: bool = False) -> torch.Tensor:
    """The NF4 blob (1-D uint8, ``NF4ChunkFormat(*w.shape, block_size, nested)``) of a chunk's
    rows ``w`` [rows, cols] (fp32, bf16 or fp16): bitsandbytes' ``quantize_4bit(w,
    blocksize=block_size, quant_type="nf4", compress_statistics=nested)`` codes and scales, bit
    for bit, laid out as [Note: quantized chunk blob] says."""
    check_weight(w, "nf4")
    fmt = NF4ChunkFormat(int(w.shape[0]), int(w.shape[1]), block_size, nested)
    # bitsandbytes' default (pure torch) quantize_4bit, the kernel its CPU backend runs.
    flat = w.reshape(-1).float()
    rem = fmt.numel % block_size
    full = fmt.numel - rem
    blocks = flat[:full].view(full // block_size, block_size)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if rem:  # the partial last block, as bitsandbytes: its stored absmax clamped, a true division
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    if scaled.numel() % 2:  # an odd count: bitsandbytes pads with 0.0 (code 7, the last low nibble)
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    q = torch.bucketize(scaled, table("nf4_bounds", w.device), out_int32=True).to(torch.uint8)
    codes = (q[::2] << 4) | q[1::2]  # element 2k in the high nibble
    if not nested:
        return torch.cat([codes, as_bytes(absmax)])
    # bitsandbytes' compress_statistics: offset = mean, then quantize_blockwise(absmax - offset, 256)
    offset = absmax.mean()
    scale_codes, absmax2 = quantize_blockwise_dynamic(absmax - offset, NESTED_BLOCK)
    return torch.cat([codes, scale_codes, as_bytes(absmax2), as_bytes(offset.reshape(1))])
