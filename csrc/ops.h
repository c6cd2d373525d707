// Argument checks shared by every C++ impl of the elastic::* ops (CPU in csrc/*.cpp, CUDA in
// csrc/cuda/*_binding.cpp). Includes torch: never include this from a .cu file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

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

}  // namespace elastic
