// C++ CPU impls of elastic::pack_shards and elastic::unpack_gathered: one memcpy per
// contiguous run, addressed with the same index functions as the CUDA kernels
// (elastic/chunk_layout.h); large runs go through torch's multi-threaded copy_ [Note: CPU copies].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "elastic/chunk_layout.h"
#include "ops.h"

namespace elastic {
namespace {

// [Note: CPU copies] Both ops are a list of contiguous runs (chunk_layout.h). A run below
// kTorchCopyBytes is one memcpy on the calling thread. A larger run is handed to torch's own
// copy_ (through byte views of the two ranges), which spreads it over the intra-op threads as
// torch.cat does. at::parallel_for cannot do that here: ATen's OpenMP backend defines
// INTRA_OP_PARALLEL only under _OPENMP, so in this extension (built without -fopenmp, and it
// should not bring a second OpenMP runtime next to torch's) it runs the loop serially.
// Measured with 2 threads on the 2-core development VM (NOTES.md, "pack/unpack on CPU").
constexpr int64_t kTorchCopyBytes = int64_t{256} << 10;

struct Run {
  char* dst;
  const char* src;
  int64_t bytes;
};

void copy_runs(const std::vector<Run>& runs) {
  for (const Run& r : runs) {
    if (r.bytes < kTorchCopyBytes || at::get_num_threads() == 1) {
      std::memcpy(r.dst, r.src, static_cast<size_t>(r.bytes));
    } else {
      const auto bytes = at::TensorOptions().dtype(at::kByte);
      at::from_blob(r.dst, {r.bytes}, bytes).copy_(at::from_blob(const_cast<char*>(r.src), {r.bytes}, bytes));
    }
  }
}

at::Tensor pack_shards_cpu(at::TensorList shards, c10::IntArrayRef slice_numels,
                           c10::IntArrayRef chunk_begins, c10::IntArrayRef chunk_ends) {
  const PackPlan plan = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends);
  at::Tensor out = at::empty({plan.total}, shards[0].options());
  const int64_t es = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  std::vector<Run> runs;
  runs.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    const int64_t s = slice_numels[i];
    const int64_t count = layout::segment_numel(chunk_ends[i] - chunk_begins[i], s);
    if (count == 0) continue;
    const char* src = static_cast<const char*>(shards[i].data_ptr()) +
                      layout::shard_offset(chunk_begins[i], s) * es;
    runs.push_back({dst + plan.out_offset[i] * es, src, count * es});
  }
  copy_runs(runs);
  return out;
}

void unpack_gathered_cpu(const at::Tensor& gathered, int64_t world_size, c10::IntArrayRef slice_numels,
                         c10::IntArrayRef chunk_counts, at::TensorList dests) {
  const UnpackPlan plan = check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests);
  const int64_t es = gathered.element_size();
  const char* src = gathered.numel() > 0 ? static_cast<const char*>(gathered.data_ptr()) : nullptr;
  std::vector<Run> runs;
  for (size_t k = 0; k < dests.size(); ++k) {
    const int64_t s = slice_numels[plan.dest_weight[k]];
    const int64_t n = dests[k].numel();
    char* dst = static_cast<char*>(dests[k].data_ptr());
    for (int64_t r = 0; r < layout::dest_runs(n, s); ++r) {
      runs.push_back({dst + layout::dest_run_offset(r, s) * es,
                      src + layout::gathered_index(r, plan.per_rank, plan.dest_base[k], 0) * es,
                      layout::run_numel(n, s, r) * es});
    }
  }
  copy_runs(runs);
}

}  // namespace
}  // namespace elastic

TORCH_LIBRARY_IMPL(elastic, CPU, m) {
  m.impl("pack_shards", &elastic::pack_shards_cpu);
  m.impl("unpack_gathered", &elastic::unpack_gathered_cpu);
}
