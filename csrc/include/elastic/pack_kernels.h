// C-style interface of the CUDA kernels in csrc/cuda/pack_kernels.cu: raw pointers, element
// size and stream only, so the kernels' translation unit never includes torch headers.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "elastic/chunk_layout.h"

namespace elastic {
namespace cuda {

// Run every copy described by descs_device[0, num_descs) (device memory; tile_begin ascending,
// covering [0, total_tiles) without gaps, every descriptor owning at least one tile) on
// `stream`, in one kernel launch. Used by both elastic::pack_shards and elastic::unpack_gathered
// [Note: one copy descriptor for pack and unpack]. Returns the launch error, if any.
cudaError_t launch_chunk_copies(const layout::CopyDesc* descs_device, int64_t num_descs,
                                int64_t total_tiles, int64_t elem_size, cudaStream_t stream);

}  // namespace cuda
}  // namespace elastic
