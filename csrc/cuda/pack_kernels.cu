// CUDA kernels of elastic::pack_shards and elastic::unpack_gathered: one batched copy kernel
// driven by a device-side table of copy descriptors [Note: one copy descriptor for pack and
// unpack] (csrc/include/elastic/chunk_layout.h). Includes only CUDA headers and elastic/*.h.
#include <cuda_runtime.h>
#include <stdint.h>

#include "elastic/chunk_layout.h"
#include "elastic/pack_kernels.h"

namespace elastic {
namespace cuda {
namespace {

using layout::CopyDesc;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// One pass of a block moves kThreads * kUnroll units; with 16-byte units that is one tile.
static_assert(kThreads * kUnroll * 16 == layout::kTileBytes, "tile = one pass of 16-byte units");
// Enough blocks to fill any current GPU many times over; larger copies loop (grid-stride).
constexpr int64_t kMaxBlocks = 1 << 20;

// Copy bytes [begin, end) of one run (both multiples of sizeof(V)) from src to dst: every
// thread issues kUnroll independent loads before its stores.
template <typename V>
__device__ __forceinline__ void copy_tile(const char* __restrict__ src, char* __restrict__ dst,
                                          int64_t begin, int64_t end) {
  const V* s = reinterpret_cast<const V*>(src + begin);
  V* d = reinterpret_cast<V*>(dst + begin);
  const int64_t n = (end - begin) / static_cast<int64_t>(sizeof(V));
  for (int64_t base = 0; base < n; base += kThreads * kUnroll) {
    V regs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < n) regs[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < n) d[i] = regs[u];
    }
  }
}

// Index of the descriptor owning global tile `tile`: the last one with tile_begin <= tile.
__device__ __forceinline__ int64_t find_desc(const CopyDesc* descs, int64_t num_descs, int64_t tile) {
  int64_t lo = 0, hi = num_descs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (descs[mid].tile_begin <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads)
chunk_copy_kernel(const CopyDesc* __restrict__ descs, int64_t num_descs, int64_t total_tiles,
                  int64_t elem_size) {
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const CopyDesc d = descs[find_desc(descs, num_descs, tile)];
    const int64_t t = tile - d.tile_begin;
    const int64_t run = t / d.tiles_per_run;
    const int64_t begin = (t % d.tiles_per_run) * layout::kTileBytes;
    const int64_t run_bytes = layout::run_numel(d.numel, d.slice_numel, run) * elem_size;
    if (begin >= run_bytes) continue;  // a tile past the end of a ragged last run (block-uniform)
    const int64_t end = layout::min64(begin + layout::kTileBytes, run_bytes);
    // Run `run` of the dest: rank `run`'s slice, read from its block of the gathered buffer.
    const char* src = d.src + layout::gathered_index(run, d.src_stride, 0, 0) * elem_size;
    char* dst = d.dst + layout::dest_run_offset(run, d.slice_numel) * elem_size;
    switch (d.vec_bytes) {
      case 16: copy_tile<uint4>(src, dst, begin, end); break;
      case 8: copy_tile<uint2>(src, dst, begin, end); break;
      case 4: copy_tile<uint32_t>(src, dst, begin, end); break;
      case 2: copy_tile<uint16_t>(src, dst, begin, end); break;
      default: copy_tile<uint8_t>(src, dst, begin, end); break;
    }
  }
}

}  // namespace

cudaError_t launch_chunk_copies(const CopyDesc* descs_device, int64_t num_descs, int64_t total_tiles,
                                int64_t elem_size, cudaStream_t stream) {
  if (total_tiles <= 0 || num_descs <= 0) return cudaSuccess;
  const int64_t blocks = total_tiles < kMaxBlocks ? total_tiles : kMaxBlocks;
  chunk_copy_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      descs_device, num_descs, total_tiles, elem_size);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace elastic
