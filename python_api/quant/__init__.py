"""Quantized frozen weights in the library (ARCHITECTURE.md, wave 3: weight format): the
policy's weight_format applied to the weights under the runtime. The formats themselves (blob
layout, quantizers, dequantization ops) are the kernels layer's: elastic_kernels/quant and
elastic_kernels/ops/dequant.py.

  weights.py    the QuantizedLayout of a registered weight, quantizing each rank's shard of its
                image from the weight's rows (a tensor or a file), one chunk at a time, or
                copying it from a file that holds it quantized (PackedRows)
  workspace.py  dequantizing a use's chunks into the compute dtype, into a recycled workspace

[Note: quantized frozen weights]
With `ElasticPolicy(weight_format="nf4" | "int8")` every frozen weight under the runtime is
stored quantized, and only quantized:
- Chunks: a weight is cut into chunks of the same whole rows as unquantized (`rows_per_chunk`
  from the weight's own dtype and `chunk_bytes`), so chunk counts, residency, plans and the
  GEMM's chunking do not change with the format; each chunk becomes one blob ([Note: quantized
  chunk blob] in elastic_kernels/quant/blob.py). The one exception: a chunk holds whole blocks
  too, so when the block does not divide the row (688 weights, block 64) rows_per_chunk is
  rounded to a multiple of block / gcd(row length, block) (`ElasticPolicy.weight_rows_per_chunk`;
  the row layout and the image's agree, and the planners round alike). A pool page holds one blob: pages are the
  quantized chunk's size, so one budget holds about 3.6x (nf4; 3.9x with nested scales) or 2x
  (int8) the chunks of bf16, 7.1x / 7.8x / 3.9x those of fp32.
- Storage: the weight's *image* (its blobs concatenated, 1-D uint8) is what the runtime shards
  (`QuantizedLayout.image_layout(W)`), packs, all-gathers and caches, with the machinery of any
  weight: `ElasticTensor.storage` is that layout, `ElasticTensor.layout` stays the weight's
  row layout (rows, cols, rows_per_chunk) that the layers compute with. So the all-gather
  moves exactly the slices of the image: per chunk gathered, (W - 1) x ceil(full blob / W)
  bytes received, i.e. the analytic quantized size plus only the slice padding every weight
  has ([Note: chunk-major shard layout] in elastic_kernels/layout.py: under W bytes per full
  chunk, the ragged last chunk padded to a full chunk's slices). tests/quant checks it byte
  for byte at budgets 0, partial and all.
- Quantized once, where the weight is read: a rank builds its shard of the image chunk by
  chunk (`quantized_shard`), quantizing the rows of one chunk at a time and keeping only its
  own slice of the blob: no rank ever holds the full-precision weight beyond the chunk being
  quantized, nor any quantized byte it does not own. Without nested scales it quantizes only
  the blocks whose codes or scales fall in its slice, reading the rows they touch (blocks are
  independent); with nested
  scales the chunk's statistics (the offset is the mean of the chunk's absmax) need every row
  of the chunk. A checkpoint saved quantized by bitsandbytes (4-bit nf4) is not quantized
  again: its codes and scales are copied into the image as they are (`PackedRows`,
  [Note: loading a bitsandbytes 4-bit checkpoint] in python_api/loading/bnb.py).
- Per use: the layer asks for the chunks and gets them dequantized into the compute dtype
  (`dequantize_use`), one `elastic_kernels.dequantize` call per use (per chunk on the
  chunk-by-chunk path of `ElasticLinear`), into a workspace the runtime recycles across uses;
  then the unquantized path runs unchanged (the paged GEMMs on the workspace's chunk views).
  The dequantized weight lives for one use only.
- The host tier (`weights_on="host"`, `host_fraction > 0`): the node's host store holds each
  weight's image too, filled by the local ranks, each quantizing only the rows it fills
  ([Note: filling the host store] in python_api/host/sources.py); a host chunk's copy moves its
  blob into the page (H2D bytes per chunk = the analytic blob size, no slice padding), and the
  use dequantizes it as it does a gathered one. `load_state_dict` into a host weight
  re-quantizes it into the store.
- Merging and export: `full_weight` gathers the image and returns the dequantized weight in
  the weight's dtype; `merge_adapters` adds s·B·A to it (and warns, as PEFT does, that merging
  into a quantized base rounds); a state dict of a quantized model holds the dequantized
  weights, and loading a state dict into one re-quantizes them.
"""

from .weights import PackedRows, fill_image_share, quantized_layout, quantized_shard
from .workspace import DequantWorkspace, dequantize_use

__all__ = ["DequantWorkspace", "PackedRows", "dequantize_use", "fill_image_share", "quantized_layout",
           "quantized_shard"]
