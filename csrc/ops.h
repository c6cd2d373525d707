// Argument checks shared by every C++ impl of the elastic::* ops (CPU in csrc/*.cpp, CUDA in
// csrc/cuda/*_binding.cpp). Includes torch: never include this from a .cu file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "elastic/quant_blob.h"

namespace elastic {

// What pack_shards will do, once its arguments are known to be valid.
struct PackPlan {
  int64_t total = 0;                // numel of the send buffer
  std::vector<int64_t> out_offset;  // per weight: where its slices start in the send buffer
};

// What unpack_gathered will do, once its arguments are known to be valid.
struct UnpackPlan {
  int64_t per_rank = 0;              // elements of one rank's block of `gathered`
  std::vector<int64_t> dest_weight;  // per dest: index of its weight
  std::vector<int64_t> dest_base;    // per dest: chunk_base() of its chunk inside a rank's block
};

// Every check raises a c10::ValueError (Python ValueError) naming the argument at fault.
PackPlan check_pack_args(at::TensorList shards, c10::IntArrayRef slice_numels,
                         c10::IntArrayRef chunk_begins, c10::IntArrayRef chunk_ends);

UnpackPlan check_unpack_args(const at::Tensor& gathered, int64_t world_size,
                             c10::IntArrayRef slice_numels, c10::IntArrayRef chunk_counts,
                             at::TensorList dests);

// What a dequant op will do (elastic_kernels/quant/blob.py [Note: quantized chunk blob]).
struct DequantPlan {
  quant::Format format = quant::Format::kNF4;
  int64_t cols = 0;
  int64_t block = 0;
  bool nested = false;
  int64_t rows_per_chunk = 0;
  int64_t last_rows = 0;      // rows of the last chunk (== rows_per_chunk unless ragged)
  quant::BlobLayout full{};   // the blob of a full chunk
  quant::BlobLayout last{};   // the blob of the last chunk
};

// The checks of elastic_kernels/ops/_checks.py check_dequant_args, in the same order with the
// same messages: c10::ValueError (ValueError) or c10::TypeError (TypeError) for dtypes.
// `dtype` is the functional op's output dtype (nullopt for the _into op, which passes `out`).
DequantPlan check_dequant_args(const char* op, at::TensorList blobs, c10::string_view format,
                               int64_t rows, int64_t cols, int64_t rows_per_chunk,
                               int64_t block_size, bool nested,
                               std::optional<at::ScalarType> dtype, const at::Tensor* out);

}  // namespace elastic
