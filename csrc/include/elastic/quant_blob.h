// Byte layout and decode arithmetic of a quantized chunk blob (NF4, blockwise int8), shared by
// the C++ CPU impl (csrc/quant/dequant_cpu.cpp) and the argument checks (csrc/ops.cpp), and
// written so that a CUDA kernel can include it (ELASTIC_HD, no torch). The Python twin, and the
// Note that defines the layout, is elastic_kernels/quant/blob.py [Note: quantized chunk blob];
// the Triton kernels (elastic_kernels/ops/dequant_kernels.py) restate the same offsets.
//
// This header includes nothing from torch: .cu files may include it.
//
// Blob of a chunk of `rows` x `cols` weights, n = rows * cols, nb = ceil(n / block): blocks run
// over the chunk's weights flattened row-major, the last one partial when block does not divide
// n (only the weight's last chunk can have one: every other chunk holds whole blocks).
//   nf4            codes  [0, ceil(n/2))     two 4-bit codes per byte, element 2k in the HIGH
//                                            nibble, 2k+1 in the low one (bitsandbytes' order;
//                                            an odd n leaves the last low nibble unused)
//                  scales [.., + 4 nb)       fp32 absmax per block
//   nf4, nested    codes  [0, ceil(n/2))
//                  scales [.., + nb)         uint8 code of (absmax - offset) per block, 8-bit
//                                            dynamic map, blocks of 256 scales
//                  nested [.., + 4 ceil(nb / 256))  fp32 absmax of each block of 256 scales
//                  offset [.., + 4)          fp32 mean of the chunk's absmax
//   int8           codes  [0, n)             int8 q = round(w / absmax * 127)
//                  scales [n, n + 4 nb)      fp32 step absmax / 127 per block
// No padding anywhere: the fp32 fields may be unaligned, so they are read with memcpy.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ELASTIC_HD __host__ __device__
#else
#define ELASTIC_HD
#endif

namespace elastic {
namespace quant {

enum class Format : int { kNF4 = 0, kInt8 = 1 };

// Scales per block of the nested (double) quantization, as bitsandbytes' compress_statistics.
constexpr int64_t kNestedBlock = 256;
// Block sizes every impl accepts: powers of two in [kMinBlock, kMaxBlock] (bitsandbytes' 4-bit
// block sizes; a power of two makes a block index a shift in the kernels).
constexpr int64_t kMinBlock = 32;
constexpr int64_t kMaxBlock = 4096;

ELASTIC_HD inline bool valid_block_size(int64_t b) {
  return b >= kMinBlock && b <= kMaxBlock && (b & (b - 1)) == 0;
}

// Byte offsets of the sections of one blob (unused sections are empty: offset == next one).
struct BlobLayout {
  int64_t codes;          // always 0
  int64_t scales;         // fp32 absmax / int8 step, or the uint8 scale codes when nested
  int64_t nested_scales;  // fp32 absmax of each block of kNestedBlock scales (nested only)
  int64_t offset;         // fp32 offset (nested only)
  int64_t total;          // bytes of the blob
};

ELASTIC_HD inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

ELASTIC_HD inline BlobLayout nf4_layout(int64_t rows, int64_t cols, int64_t block, bool nested) {
  const int64_t n = rows * cols, nb = ceil_div64(n, block);
  BlobLayout l;
  l.codes = 0;
  l.scales = ceil_div64(n, 2);
  if (nested) {
    l.nested_scales = l.scales + nb;
    l.offset = l.nested_scales + 4 * ceil_div64(nb, kNestedBlock);
    l.total = l.offset + 4;
  } else {
    l.nested_scales = l.offset = l.total = l.scales + 4 * nb;
  }
  return l;
}

ELASTIC_HD inline BlobLayout int8_layout(int64_t rows, int64_t cols, int64_t block) {
  const int64_t n = rows * cols;
  BlobLayout l;
  l.codes = 0;
  l.scales = n;
  l.nested_scales = l.offset = l.total = n + 4 * ceil_div64(n, block);
  return l;
}

ELASTIC_HD inline BlobLayout blob_layout(Format f, int64_t rows, int64_t cols, int64_t block, bool nested) {
  return f == Format::kNF4 ? nf4_layout(rows, cols, block, nested) : int8_layout(rows, cols, block);
}

// The fp32 at byte address p, any alignment (little-endian, like every supported target).
ELASTIC_HD inline float load_f32(const uint8_t* p) {
  float v;
  memcpy(&v, p, sizeof(v));
  return v;
}

// bitsandbytes' nibble order: the first of two elements is the high nibble.
ELASTIC_HD inline uint8_t nf4_first(uint8_t byte) { return byte >> 4; }
ELASTIC_HD inline uint8_t nf4_second(uint8_t byte) { return byte & 0x0F; }

// absmax of a block from its nested code: fl(fl(code * absmax2) + offset), two roundings, as
// bitsandbytes computes it (dequantize_blockwise, then `absmax += offset`). Never an FMA: the
// host build passes -ffp-contract=off (setup.py), device code uses the explicit _rn intrinsics.
ELASTIC_HD inline float nested_absmax(float code, float absmax2, float offset) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(code, absmax2), offset);
#else
  const float p = code * absmax2;
  return p + offset;
#endif
}

// The 16 NF4 values, bitsandbytes' table (functional.get_4bit_type("nf4"), csrc/cpu_ops.cpp),
// same decimal literals. Host tables: a CUDA kernel would copy them to __constant__ memory.
constexpr float kNF4Code[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// bitsandbytes' signed 8-bit dynamic map (functional.create_dynamic_map(), sorted), the code of
// the nested scales, as exact hex literals of its fp32 values (tests/kernels/test_quant.py
// compares every entry through the op with the Python table and with bitsandbytes').
constexpr float kDynamicCode[256] = {
    -0x1.fc66660000000p-1f, -0x1.f533340000000p-1f, -0x1.ee00000000000p-1f, -0x1.e6cccc0000000p-1f,
    -0x1.df999a0000000p-1f, -0x1.d866660000000p-1f, -0x1.d133340000000p-1f, -0x1.ca00000000000p-1f,
    -0x1.c2cccc0000000p-1f, -0x1.bb999a0000000p-1f, -0x1.b466660000000p-1f, -0x1.ad33340000000p-1f,
    -0x1.a600000000000p-1f, -0x1.9ecccc0000000p-1f, -0x1.97999a0000000p-1f, -0x1.9066660000000p-1f,
    -0x1.8933340000000p-1f, -0x1.8200000000000p-1f, -0x1.7acccc0000000p-1f, -0x1.73999a0000000p-1f,
    -0x1.6c66680000000p-1f, -0x1.6533340000000p-1f, -0x1.5e00000000000p-1f, -0x1.56cccc0000000p-1f,
    -0x1.4f999a0000000p-1f, -0x1.4866680000000p-1f, -0x1.4133340000000p-1f, -0x1.3a00000000000p-1f,
    -0x1.32cccc0000000p-1f, -0x1.2b999a0000000p-1f, -0x1.2466680000000p-1f, -0x1.1d33340000000p-1f,
    -0x1.1600000000000p-1f, -0x1.0ecccc0000000p-1f, -0x1.0799980000000p-1f, -0x1.0066660000000p-1f,
    -0x1.f266640000000p-2f, -0x1.e400000000000p-2f, -0x1.d599980000000p-2f, -0x1.c733340000000p-2f,
    -0x1.b8cccc0000000p-2f, -0x1.aa66660000000p-2f, -0x1.9c00000000000p-2f, -0x1.8d99980000000p-2f,
    -0x1.7f33340000000p-2f, -0x1.70cccc0000000p-2f, -0x1.6266660000000p-2f, -0x1.5400000000000p-2f,
    -0x1.4599980000000p-2f, -0x1.3733340000000p-2f, -0x1.28cccc0000000p-2f, -0x1.1a66680000000p-2f,
    -0x1.0c00000000000p-2f, -0x1.fb33320000000p-3f, -0x1.de66660000000p-3f, -0x1.c1999a0000000p-3f,
    -0x1.a4cccc0000000p-3f, -0x1.8800000000000p-3f, -0x1.6b33340000000p-3f, -0x1.4e66660000000p-3f,
    -0x1.31999a0000000p-3f, -0x1.14cccc0000000p-3f, -0x1.f000000000000p-4f, -0x1.b666680000000p-4f,
    -0x1.93d70a0000000p-4f, -0x1.8851ee0000000p-4f, -0x1.7cccce0000000p-4f, -0x1.7147ae0000000p-4f,
    -0x1.65c2900000000p-4f, -0x1.5a3d700000000p-4f, -0x1.4eb8540000000p-4f, -0x1.4333340000000p-4f,
    -0x1.37ae140000000p-4f, -0x1.2c28f60000000p-4f, -0x1.20a3d60000000p-4f, -0x1.151eba0000000p-4f,
    -0x1.09999a0000000p-4f, -0x1.fc28f60000000p-5f, -0x1.e51eba0000000p-5f, -0x1.ce147a0000000p-5f,
    -0x1.b70a3e0000000p-5f, -0x1.a000000000000p-5f, -0x1.88f5c20000000p-5f, -0x1.71eb860000000p-5f,
    -0x1.5ae1460000000p-5f, -0x1.43d70a0000000p-5f, -0x1.2cccce0000000p-5f, -0x1.15c2900000000p-5f,
    -0x1.fd70a40000000p-6f, -0x1.cf5c2a0000000p-6f, -0x1.a147ae0000000p-6f, -0x1.7333340000000p-6f,
    -0x1.451eba0000000p-6f, -0x1.170a3e0000000p-6f, -0x1.d1eb860000000p-7f, -0x1.75c2900000000p-7f,
    -0x1.3e76c80000000p-7f, -0x1.2c08300000000p-7f, -0x1.19999a0000000p-7f, -0x1.072b020000000p-7f,
    -0x1.e978d40000000p-8f, -0x1.c49ba60000000p-8f, -0x1.9fbe760000000p-8f, -0x1.7ae1480000000p-8f,
    -0x1.56041a0000000p-8f, -0x1.3126e80000000p-8f, -0x1.0c49ba0000000p-8f, -0x1.ced9140000000p-9f,
    -0x1.851eb80000000p-9f, -0x1.3b645a0000000p-9f, -0x1.e353f80000000p-10f, -0x1.4fdf3a0000000p-10f,
    -0x1.eecbfe0000000p-11f, -0x1.b3d07c0000000p-11f, -0x1.78d5000000000p-11f, -0x1.3dd9820000000p-11f,
    -0x1.02de020000000p-11f, -0x1.8fc5060000000p-12f, -0x1.19ce0a0000000p-12f, -0x1.47ae160000000p-13f,
    -0x1.743e960000000p-14f, -0x1.15df660000000p-14f, -0x1.6f00680000000p-15f, -0x1.64840c0000000p-16f,
    -0x1.040bfe0000000p-17f, -0x1.b435280000000p-19f, -0x1.27476e0000000p-21f, 0x0.0p+0f,
    0x1.27476e0000000p-21f, 0x1.b435280000000p-19f, 0x1.040bfe0000000p-17f, 0x1.64840c0000000p-16f,
    0x1.6f00680000000p-15f, 0x1.15df660000000p-14f, 0x1.743e960000000p-14f, 0x1.47ae160000000p-13f,
    0x1.19ce0a0000000p-12f, 0x1.8fc5060000000p-12f, 0x1.02de020000000p-11f, 0x1.3dd9820000000p-11f,
    0x1.78d5000000000p-11f, 0x1.b3d07c0000000p-11f, 0x1.eecbfe0000000p-11f, 0x1.4fdf3a0000000p-10f,
    0x1.e353f80000000p-10f, 0x1.3b645a0000000p-9f, 0x1.851eb80000000p-9f, 0x1.ced9140000000p-9f,
    0x1.0c49ba0000000p-8f, 0x1.3126e80000000p-8f, 0x1.56041a0000000p-8f, 0x1.7ae1480000000p-8f,
    0x1.9fbe760000000p-8f, 0x1.c49ba60000000p-8f, 0x1.e978d40000000p-8f, 0x1.072b020000000p-7f,
    0x1.19999a0000000p-7f, 0x1.2c08300000000p-7f, 0x1.3e76c80000000p-7f, 0x1.75c2900000000p-7f,
    0x1.d1eb860000000p-7f, 0x1.170a3e0000000p-6f, 0x1.451eba0000000p-6f, 0x1.7333340000000p-6f,
    0x1.a147ae0000000p-6f, 0x1.cf5c2a0000000p-6f, 0x1.fd70a40000000p-6f, 0x1.15c2900000000p-5f,
    0x1.2cccce0000000p-5f, 0x1.43d70a0000000p-5f, 0x1.5ae1460000000p-5f, 0x1.71eb860000000p-5f,
    0x1.88f5c20000000p-5f, 0x1.a000000000000p-5f, 0x1.b70a3e0000000p-5f, 0x1.ce147a0000000p-5f,
    0x1.e51eba0000000p-5f, 0x1.fc28f60000000p-5f, 0x1.09999a0000000p-4f, 0x1.151eba0000000p-4f,
    0x1.20a3d60000000p-4f, 0x1.2c28f60000000p-4f, 0x1.37ae140000000p-4f, 0x1.4333340000000p-4f,
    0x1.4eb8540000000p-4f, 0x1.5a3d700000000p-4f, 0x1.65c2900000000p-4f, 0x1.7147ae0000000p-4f,
    0x1.7cccce0000000p-4f, 0x1.8851ee0000000p-4f, 0x1.93d70a0000000p-4f, 0x1.b666680000000p-4f,
    0x1.f000000000000p-4f, 0x1.14cccc0000000p-3f, 0x1.31999a0000000p-3f, 0x1.4e66660000000p-3f,
    0x1.6b33340000000p-3f, 0x1.8800000000000p-3f, 0x1.a4cccc0000000p-3f, 0x1.c1999a0000000p-3f,
    0x1.de66660000000p-3f, 0x1.fb33320000000p-3f, 0x1.0c00000000000p-2f, 0x1.1a66680000000p-2f,
    0x1.28cccc0000000p-2f, 0x1.3733340000000p-2f, 0x1.4599980000000p-2f, 0x1.5400000000000p-2f,
    0x1.6266660000000p-2f, 0x1.70cccc0000000p-2f, 0x1.7f33340000000p-2f, 0x1.8d99980000000p-2f,
    0x1.9c00000000000p-2f, 0x1.aa66660000000p-2f, 0x1.b8cccc0000000p-2f, 0x1.c733340000000p-2f,
    0x1.d599980000000p-2f, 0x1.e400000000000p-2f, 0x1.f266640000000p-2f, 0x1.0066660000000p-1f,
    0x1.0799980000000p-1f, 0x1.0ecccc0000000p-1f, 0x1.1600000000000p-1f, 0x1.1d33340000000p-1f,
    0x1.2466680000000p-1f, 0x1.2b999a0000000p-1f, 0x1.32cccc0000000p-1f, 0x1.3a00000000000p-1f,
    0x1.4133340000000p-1f, 0x1.4866680000000p-1f, 0x1.4f999a0000000p-1f, 0x1.56cccc0000000p-1f,
    0x1.5e00000000000p-1f, 0x1.6533340000000p-1f, 0x1.6c66680000000p-1f, 0x1.73999a0000000p-1f,
    0x1.7acccc0000000p-1f, 0x1.8200000000000p-1f, 0x1.8933340000000p-1f, 0x1.9066660000000p-1f,
    0x1.97999a0000000p-1f, 0x1.9ecccc0000000p-1f, 0x1.a600000000000p-1f, 0x1.ad33340000000p-1f,
    0x1.b466660000000p-1f, 0x1.bb999a0000000p-1f, 0x1.c2cccc0000000p-1f, 0x1.ca00000000000p-1f,
    0x1.d133340000000p-1f, 0x1.d866660000000p-1f, 0x1.df999a0000000p-1f, 0x1.e6cccc0000000p-1f,
    0x1.ee00000000000p-1f, 0x1.f533340000000p-1f, 0x1.fc66660000000p-1f, 0x1.0000000000000p+0f,
};

}  // namespace quant
}  // namespace elastic
