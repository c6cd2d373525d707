// Index math of the chunk-major shard layout, shared by the C++ CPU impls (csrc/pack.cpp), the
// CUDA binding (csrc/cuda/pack_binding.cpp) and the CUDA kernels (csrc/cuda/pack_kernels.cu),
// so the CPU tests check the very arithmetic the kernels run. The Python twin, and the Note
// that defines the layout, is elastic_kernels/layout.py [Note: chunk-major shard layout].
//
// This header includes nothing from torch: .cu files include it and must stay cheap to compile.
//
// Vocabulary (all counts in elements unless a name says bytes):
//   s          slice_numel of a weight: every chunk is split into world_size slices of s
//              elements (zero-padded at the chunk's end); rank r's shard holds slice r of each
//              chunk, chunk after chunk.
//   pack       for weight i, shard_i[chunk_begin*s, chunk_end*s) is appended to the send buffer.
//   gathered   the all-gather output: world_size blocks (one per rank) of per_rank elements;
//              block r = rank r's pack. Weight i's segment starts at seg_offset_i in a block.
//   dest       one chunk's destination (numel <= world_size * s, the chunk's unpadded size).
//              dest.flat[e] = gathered.flat[r*per_rank + seg_offset_i + j*s + o],
//              r = e / s, o = e % s. A dest is thus ceil(numel / s) contiguous *runs*: run r is
//              dest[r*s, r*s + run_numel) <- gathered[r*per_rank + chunk_base, + run_numel).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ELASTIC_HD __host__ __device__
#else
#define ELASTIC_HD
#endif

namespace elastic {
namespace layout {

ELASTIC_HD inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
ELASTIC_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- pack ----

// First element of chunk `chunk` in a shard (and in the slice range that pack copies).
ELASTIC_HD inline int64_t shard_offset(int64_t chunk, int64_t slice_numel) { return chunk * slice_numel; }

// Elements a weight contributes to one rank's pack (= its segment in each gathered block).
ELASTIC_HD inline int64_t segment_numel(int64_t chunk_count, int64_t slice_numel) {
  return chunk_count * slice_numel;
}

// ---- unpack ----

// Offset, inside one rank's block, of chunk j (0-based within the weight's chunk range) of the
// weight whose segment starts at seg_offset.
ELASTIC_HD inline int64_t chunk_base(int64_t seg_offset, int64_t j, int64_t slice_numel) {
  return seg_offset + j * slice_numel;
}

// Flat index in `gathered` of element o of rank r's slice of the chunk at chunk_base.
ELASTIC_HD inline int64_t gathered_index(int64_t r, int64_t per_rank, int64_t base, int64_t o) {
  return r * per_rank + base + o;
}

// Number of runs (ranks whose slice holds real elements) of a dest of dest_numel elements.
ELASTIC_HD inline int64_t dest_runs(int64_t dest_numel, int64_t slice_numel) {
  return ceil_div(dest_numel, slice_numel);
}

// Elements of run r of a dest: s, except the last run of a ragged chunk (padding is dropped).
ELASTIC_HD inline int64_t run_numel(int64_t dest_numel, int64_t slice_numel, int64_t r) {
  return min64(slice_numel, dest_numel - r * slice_numel);
}

// First element of run r in the dest.
ELASTIC_HD inline int64_t dest_run_offset(int64_t r, int64_t slice_numel) { return r * slice_numel; }

// ---- batched strided copy (one descriptor per pack segment or per unpack dest) ----

// [Note: one copy descriptor for pack and unpack]
// Both ops are a batch of "runs": contiguous byte ranges copied from src to dst. A descriptor
// covers the runs of one pack segment (a single run) or one unpack dest (dest_runs() runs, run r
// read at src + r*src_stride elements and written at dst + r*slice_numel elements), so one kernel
// launch serves any number of weights and dests. The work is cut into tiles of kTileBytes of one
// run; descriptor k owns the global tiles [tile_begin, tile_begin + runs * tiles_per_run), and a
// thread block finds its descriptor by binary search on tile_begin. vec_bytes is the widest
// power of two (<= 16) dividing every address and length the descriptor touches, so the kernel
// copies in units of vec_bytes without a head/tail case (any 1/2/4/8-byte dtype is just bytes).
constexpr int64_t kTileBytes = 16384;

struct CopyDesc {
  const char* src;       // byte address of run 0's first element
  char* dst;             // byte address of the dest's first element
  int64_t src_stride;    // elements between the starts of consecutive runs in src (per_rank)
  int64_t slice_numel;   // elements of a full run; also the dst stride between runs
  int64_t numel;         // elements of the whole dest (pack: of the segment)
  int64_t tile_begin;    // first global tile of this descriptor
  int64_t tiles_per_run; // ceil(slice_numel * elem_size / kTileBytes)
  int64_t vec_bytes;     // copy unit: 1, 2, 4, 8 or 16
};

// Widest power of two <= 16 that divides x (16 when x == 0).
ELASTIC_HD inline int64_t pow2_divisor16(uint64_t x) {
  uint64_t v = x | 16u;
  return static_cast<int64_t>(v & (~v + 1));  // lowest set bit
}

// Fill the derived fields of d (tile_begin excluded) and return its tile count.
// Requires d.numel > 0 and d.slice_numel > 0.
inline int64_t plan_desc(CopyDesc& d, int64_t elem_size) {
  const int64_t runs = dest_runs(d.numel, d.slice_numel);
  const int64_t run_bytes = d.slice_numel * elem_size;
  d.tiles_per_run = ceil_div(run_bytes, kTileBytes);
  uint64_t bits = reinterpret_cast<uintptr_t>(d.src) | reinterpret_cast<uintptr_t>(d.dst) |
                  static_cast<uint64_t>(run_bytes) | static_cast<uint64_t>(d.numel * elem_size);
  if (runs > 1) bits |= static_cast<uint64_t>(d.src_stride * elem_size);
  d.vec_bytes = pow2_divisor16(bits);
  return runs * d.tiles_per_run;
}

}  // namespace layout
}  // namespace elastic
