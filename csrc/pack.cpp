// C++ CPU impls of elastic::pack_shards and elastic::unpack_gathered: one memcpy per
// contiguous run, addressed with the same index functions as the CUDA kernels
// (elastic/chunk_layout.h). Single-threaded: see bench/bench_pack.py and NOTES.md for the
// measured comparison against torch.cat / copy_ that this choice rests on.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "elastic/chunk_layout.h"
#include "ops.h"

namespace elastic {
namespace {

at::Tensor pack_shards_cpu(at::TensorList shards, c10::IntArrayRef slice_numels,
                           c10::IntArrayRef chunk_begins, c10::IntArrayRef chunk_ends) {
  const PackPlan plan = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends);
  at::Tensor out = at::empty({plan.total}, shards[0].options());
  const int64_t es = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < shards.size(); ++i) {
    const int64_t s = slice_numels[i];
    const int64_t count = layout::segment_numel(chunk_ends[i] - chunk_begins[i], s);
    if (count == 0) continue;
    const char* src = static_cast<const char*>(shards[i].data_ptr()) +
                      layout::shard_offset(chunk_begins[i], s) * es;
    std::memcpy(dst + plan.out_offset[i] * es, src, static_cast<size_t>(count * es));
  }
  return out;
}

void unpack_gathered_cpu(const at::Tensor& gathered, int64_t world_size, c10::IntArrayRef slice_numels,
                         c10::IntArrayRef chunk_counts, at::TensorList dests) {
  const UnpackPlan plan = check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests);
  const int64_t es = gathered.element_size();
  const char* src = gathered.numel() > 0 ? static_cast<const char*>(gathered.data_ptr()) : nullptr;
  for (size_t k = 0; k < dests.size(); ++k) {
    const int64_t s = slice_numels[plan.dest_weight[k]];
    const int64_t n = dests[k].numel();
    char* dst = static_cast<char*>(dests[k].data_ptr());
    for (int64_t r = 0; r < layout::dest_runs(n, s); ++r) {
      std::memcpy(dst + layout::dest_run_offset(r, s) * es,
                  src + layout::gathered_index(r, plan.per_rank, plan.dest_base[k], 0) * es,
                  static_cast<size_t>(layout::run_numel(n, s, r) * es));
    }
  }
}

}  // namespace
}  // namespace elastic

TORCH_LIBRARY_IMPL(elastic, CPU, m) {
  m.impl("pack_shards", &elastic::pack_shards_cpu);
  m.impl("unpack_gathered", &elastic::unpack_gathered_cpu);
}
