// C++ CPU impls of elastic::dequant_chunks and elastic::dequant_chunks_into: every chunk's blob
// decoded with the byte layout and arithmetic of elastic/quant_blob.h (the Python twin and its
// Note: elastic_kernels/quant/blob.py [Note: quantized chunk blob]).
//
// [Note: CPU dequant loop]
// Per quantization block: its scale s (fp32; from the nested code, nested scale and offset
// when nested), then for NF4 a 16-entry table of the block's 16 possible outputs,
// T(fl32(kNF4Code[i] * s)) rounded once to the compute dtype T (c10::BFloat16 / c10::Half
// round to nearest even, as torch's .to() and bitsandbytes' float_to_bf16 / F16C), so each
// pair of weights is two table reads; for int8 T(fl32(float(q) * s)). The same products as the
// reference and as bitsandbytes, so the same bits. One thread: like pack.cpp [Note: CPU copies],
// at::parallel_for runs serially in this extension (no -fopenmp); chunks are independent, so a
// caller may dequantize chunks in parallel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../ops.h"
#include "elastic/quant_blob.h"

namespace elastic {
namespace {

template <typename T>
inline T cast_out(float v) {
  return static_cast<T>(v);  // float: identity; BFloat16 / Half: round to nearest even
}

// Blocks run over the chunk's n weights flattened; the last block may be partial (len < block,
// odd when n is: its last weight is the high nibble of the last code byte).
template <typename T>
void dequant_nf4_chunk(const uint8_t* blob, const quant::BlobLayout& l, int64_t n, int64_t block,
                       bool nested, T* out) {
  const int64_t nb = quant::ceil_div64(n, block);
  const float offset = nested ? quant::load_f32(blob + l.offset) : 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float s;
    if (nested) {
      const float absmax2 = quant::load_f32(blob + l.nested_scales + 4 * (b / quant::kNestedBlock));
      s = quant::nested_absmax(quant::kDynamicCode[blob[l.scales + b]], absmax2, offset);
    } else {
      s = quant::load_f32(blob + l.scales + 4 * b);
    }
    T lut[16];
    for (int i = 0; i < 16; ++i) lut[i] = cast_out<T>(quant::kNF4Code[i] * s);
    const int64_t len = std::min(block, n - b * block);
    const uint8_t* codes = blob + l.codes + b * (block / 2);
    T* o = out + b * block;
    for (int64_t k = 0; k < len / 2; ++k) {
      const uint8_t byte = codes[k];
      o[2 * k] = lut[quant::nf4_first(byte)];
      o[2 * k + 1] = lut[quant::nf4_second(byte)];
    }
    if (len % 2) o[len - 1] = lut[quant::nf4_first(codes[len / 2])];
  }
}

template <typename T>
void dequant_int8_chunk(const uint8_t* blob, const quant::BlobLayout& l, int64_t n, int64_t block,
                        T* out) {
  const auto* codes = reinterpret_cast<const int8_t*>(blob + l.codes);
  const int64_t nb = quant::ceil_div64(n, block);
  for (int64_t b = 0; b < nb; ++b) {
    const float s = quant::load_f32(blob + l.scales + 4 * b);
    const int64_t len = std::min(block, n - b * block);
    const int8_t* q = codes + b * block;
    T* o = out + b * block;
    for (int64_t k = 0; k < len; ++k) o[k] = cast_out<T>(static_cast<float>(q[k]) * s);
  }
}

template <typename T>
void dequant_all(const DequantPlan& plan, at::TensorList blobs, T* out) {
  const int64_t n = static_cast<int64_t>(blobs.size());
  for (int64_t c = 0; c < n; ++c) {
    const bool last = c == n - 1;
    const quant::BlobLayout& l = last ? plan.last : plan.full;
    const int64_t weights = (last ? plan.last_rows : plan.rows_per_chunk) * plan.cols;
    const auto* blob = static_cast<const uint8_t*>(blobs[c].data_ptr());
    T* o = out + c * plan.rows_per_chunk * plan.cols;
    if (plan.format == quant::Format::kNF4) {
      dequant_nf4_chunk<T>(blob, l, weights, plan.block, plan.nested, o);
    } else {
      dequant_int8_chunk<T>(blob, l, weights, plan.block, o);
    }
  }
}

void dequant_into(const DequantPlan& plan, at::TensorList blobs, at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kFloat: dequant_all<float>(plan, blobs, out.data_ptr<float>()); break;
    case at::kBFloat16: dequant_all<c10::BFloat16>(plan, blobs, out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: dequant_all<c10::Half>(plan, blobs, out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "unreachable: the checks admit fp32, bf16 and fp16 only");
  }
}

at::Tensor dequant_chunks_cpu(at::TensorList blobs, c10::string_view format, int64_t rows,
                              int64_t cols, int64_t rows_per_chunk, int64_t block_size,
                              bool nested, at::ScalarType dtype) {
  const DequantPlan plan = check_dequant_args("elastic::dequant_chunks", blobs, format, rows, cols,
                                              rows_per_chunk, block_size, nested, dtype, nullptr);
  at::Tensor out = at::empty({rows, cols}, blobs[0].options().dtype(dtype));
  dequant_into(plan, blobs, out);
  return out;
}

void dequant_chunks_into_cpu(at::TensorList blobs, c10::string_view format, int64_t rows,
                             int64_t cols, int64_t rows_per_chunk, int64_t block_size, bool nested,
                             const at::Tensor& out) {
  const DequantPlan plan =
      check_dequant_args("elastic::dequant_chunks_into", blobs, format, rows, cols, rows_per_chunk,
                         block_size, nested, std::nullopt, &out);
  at::Tensor o = out;
  dequant_into(plan, blobs, o);
}

}  // namespace
}  // namespace elastic

TORCH_LIBRARY_IMPL(elastic, CPU, m) {
  m.impl("dequant_chunks", &elastic::dequant_chunks_cpu);
  m.impl("dequant_chunks_into", &elastic::dequant_chunks_into_cpu);
}
