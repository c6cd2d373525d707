// CUDA impls of elastic::pack_shards and elastic::unpack_gathered: argument checks, one copy
// descriptor per segment / dest [Note: one copy descriptor for pack and unpack], the table's
// upload and one kernel launch on the current stream (csrc/cuda/pack_kernels.cu).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "elastic/chunk_layout.h"
#include "elastic/pack_kernels.h"
#include "../ops.h"

namespace elastic {
namespace {

using layout::CopyDesc;

// Copy the descriptor table to the device (pinned staging, async on the current stream; the
// caching host allocator keeps the staging block until the copy has run) and launch.
void run_copies(const std::vector<CopyDesc>& descs, int64_t total_tiles, int64_t elem_size,
                const at::Device& device) {
  if (descs.empty()) return;
  const int64_t nbytes = static_cast<int64_t>(descs.size() * sizeof(CopyDesc));
  at::Tensor host = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), descs.data(), static_cast<size_t>(nbytes));
  at::Tensor table = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
  table.copy_(host, /*non_blocking=*/true);
  C10_CUDA_CHECK(cuda::launch_chunk_copies(static_cast<const CopyDesc*>(table.data_ptr()),
                                           static_cast<int64_t>(descs.size()), total_tiles,
                                           elem_size, at::cuda::getCurrentCUDAStream()));
}

at::Tensor pack_shards_cuda(at::TensorList shards, c10::IntArrayRef slice_numels,
                            c10::IntArrayRef chunk_begins, c10::IntArrayRef chunk_ends) {
  const PackPlan plan = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends);
  const c10::cuda::CUDAGuard guard(shards[0].device());
  at::Tensor out = at::empty({plan.total}, shards[0].options());
  const int64_t es = out.element_size();
  std::vector<CopyDesc> descs;
  descs.reserve(shards.size());
  int64_t total_tiles = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const int64_t s = slice_numels[i];
    const int64_t count = layout::segment_numel(chunk_ends[i] - chunk_begins[i], s);
    if (count == 0) continue;
    CopyDesc d{};
    d.src = static_cast<const char*>(shards[i].data_ptr()) + layout::shard_offset(chunk_begins[i], s) * es;
    d.dst = static_cast<char*>(out.data_ptr()) + plan.out_offset[i] * es;
    d.src_stride = 0;  // a pack segment is a single run
    d.slice_numel = count;
    d.numel = count;
    d.tile_begin = total_tiles;
    total_tiles += layout::plan_desc(d, es);
    descs.push_back(d);
  }
  run_copies(descs, total_tiles, es, out.device());
  return out;
}

void unpack_gathered_cuda(const at::Tensor& gathered, int64_t world_size, c10::IntArrayRef slice_numels,
                          c10::IntArrayRef chunk_counts, at::TensorList dests) {
  const UnpackPlan plan = check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests);
  if (dests.empty()) return;
  const c10::cuda::CUDAGuard guard(gathered.device());
  const int64_t es = gathered.element_size();
  std::vector<CopyDesc> descs;
  descs.reserve(dests.size());
  int64_t total_tiles = 0;
  for (size_t k = 0; k < dests.size(); ++k) {
    CopyDesc d{};
    d.src = static_cast<const char*>(gathered.data_ptr()) + plan.dest_base[k] * es;
    d.dst = static_cast<char*>(dests[k].data_ptr());
    d.src_stride = plan.per_rank;
    d.slice_numel = slice_numels[plan.dest_weight[k]];
    d.numel = dests[k].numel();
    d.tile_begin = total_tiles;
    total_tiles += layout::plan_desc(d, es);
    descs.push_back(d);
  }
  run_copies(descs, total_tiles, es, gathered.device());
}

}  // namespace
}  // namespace elastic

TORCH_LIBRARY_IMPL(elastic, CUDA, m) {
  m.impl("pack_shards", &elastic::pack_shards_cuda);
  m.impl("unpack_gathered", &elastic::unpack_gathered_cuda);
}
