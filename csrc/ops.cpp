// Schemas of the elastic:: namespace (the one TORCH_LIBRARY block; later ops add theirs here)
// and the argument checks shared by the C++ impls. Fake impls live in Python
// (elastic_kernels/ops/pack.py and dequant.py, named by set_python_module below).
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <tuple>

#include "elastic/chunk_layout.h"

namespace elastic {
namespace {

bool supported_elem_size(int64_t n) { return n == 1 || n == 2 || n == 4 || n == 8; }

void check_elem_size(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK_VALUE(supported_elem_size(t.element_size()), op, ": ", name, " has dtype ",
                    t.scalar_type(), " with ", t.element_size(),
                    "-byte elements; supported element sizes are 1, 2, 4 and 8 bytes");
}

void check_list_len(const char* op, const char* name, size_t got, const char* ref, size_t want) {
  TORCH_CHECK_VALUE(got == want, op, ": ", name, " has ", got, " entries but ", ref, " has ", want,
                    " (one per weight)");
}

// Raise if two of the byte ranges [start, end) overlap; names say which arguments they are.
void check_no_overlap(const char* op, std::vector<std::tuple<uintptr_t, uintptr_t, std::string>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  // Sorted by start: range k overlaps an earlier one iff it starts before the furthest end so
  // far; `far` is the earlier range reaching furthest, named in the error.
  size_t far = 0;
  for (size_t k = 1; k < ranges.size(); ++k) {
    TORCH_CHECK_VALUE(std::get<0>(ranges[k]) >= std::get<1>(ranges[far]), op, ": ",
                      std::get<2>(ranges[far]), " and ", std::get<2>(ranges[k]),
                      " overlap in memory; every dest must have memory of its own, apart from "
                      "gathered and from the other dests");
    if (std::get<1>(ranges[k]) > std::get<1>(ranges[far])) far = k;
  }
}

}  // namespace

PackPlan check_pack_args(at::TensorList shards, c10::IntArrayRef slice_numels,
                         c10::IntArrayRef chunk_begins, c10::IntArrayRef chunk_ends) {
  constexpr const char* op = "elastic::pack_shards";
  const size_t n = shards.size();
  TORCH_CHECK_VALUE(n > 0, op, ": shards must not be empty (the send buffer takes its dtype and "
                    "device from shards[0])");
  check_list_len(op, "slice_numels", slice_numels.size(), "shards", n);
  check_list_len(op, "chunk_begins", chunk_begins.size(), "shards", n);
  check_list_len(op, "chunk_ends", chunk_ends.size(), "shards", n);
  const at::Tensor& first = shards[0];
  PackPlan plan;
  plan.out_offset.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = shards[i];
    const std::string name = "shards[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK_VALUE(t.scalar_type() == first.scalar_type(), op, ": ", name, " has dtype ",
                      t.scalar_type(), " but shards[0] has dtype ", first.scalar_type(),
                      "; all shards must have one dtype");
    TORCH_CHECK_VALUE(t.device() == first.device(), op, ": ", name, " is on device ", t.device(),
                      " but shards[0] is on ", first.device(), "; all shards must be on one device");
    check_elem_size(t, op, name);
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D (a flat shard), got shape ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
    const int64_t s = slice_numels[i];
    TORCH_CHECK_VALUE(s >= 1, op, ": slice_numels[", i, "] must be >= 1, got ", s);
    TORCH_CHECK_VALUE(t.numel() % s == 0, op, ": ", name, " has ", t.numel(),
                      " elements, not a multiple of slice_numels[", i, "] = ", s);
    const int64_t chunks = t.numel() / s;
    const int64_t cb = chunk_begins[i], ce = chunk_ends[i];
    TORCH_CHECK_VALUE(0 <= cb && cb <= ce && ce <= chunks, op, ": chunk range [chunk_begins[", i,
                      "], chunk_ends[", i, "]) = [", cb, ", ", ce, ") is not within the ", chunks,
                      " chunks of ", name, " (need 0 <= begin <= end <= ", chunks, ")");
    plan.out_offset[i] = plan.total;
    plan.total += layout::segment_numel(ce - cb, s);
  }
  return plan;
}

UnpackPlan check_unpack_args(const at::Tensor& gathered, int64_t world_size,
                             c10::IntArrayRef slice_numels, c10::IntArrayRef chunk_counts,
                             at::TensorList dests) {
  constexpr const char* op = "elastic::unpack_gathered";
  TORCH_CHECK_VALUE(world_size >= 1, op, ": world_size must be >= 1, got ", world_size);
  check_list_len(op, "chunk_counts", chunk_counts.size(), "slice_numels", slice_numels.size());
  TORCH_CHECK_VALUE(gathered.defined(), op, ": gathered is undefined");
  check_elem_size(gathered, op, "gathered");
  TORCH_CHECK_VALUE(gathered.is_contiguous(), op, ": gathered must be contiguous");

  UnpackPlan plan;
  std::vector<int64_t> seg_offset(slice_numels.size());
  int64_t num_dests = 0;
  for (size_t i = 0; i < slice_numels.size(); ++i) {
    TORCH_CHECK_VALUE(slice_numels[i] >= 1, op, ": slice_numels[", i, "] must be >= 1, got ",
                      slice_numels[i]);
    TORCH_CHECK_VALUE(chunk_counts[i] >= 0, op, ": chunk_counts[", i, "] must be >= 0, got ",
                      chunk_counts[i]);
    seg_offset[i] = plan.per_rank;
    plan.per_rank += layout::segment_numel(chunk_counts[i], slice_numels[i]);
    num_dests += chunk_counts[i];
  }
  TORCH_CHECK_VALUE(gathered.dim() == 1 || (gathered.dim() == 2 && gathered.size(0) == world_size),
                    op, ": gathered must be 1-D or [world_size, per_rank] = [", world_size, ", ",
                    plan.per_rank, "], got shape ", gathered.sizes());
  TORCH_CHECK_VALUE(gathered.numel() == world_size * plan.per_rank, op, ": gathered has ",
                    gathered.numel(), " elements but world_size * per_rank = ", world_size, " * ",
                    plan.per_rank, " = ", world_size * plan.per_rank,
                    " (per_rank = sum of chunk_counts[i] * slice_numels[i])");
  TORCH_CHECK_VALUE(static_cast<int64_t>(dests.size()) == num_dests, op, ": dests has ",
                    dests.size(), " tensors but sum(chunk_counts) = ", num_dests,
                    " (one dest per chunk)");

  plan.dest_weight.resize(dests.size());
  plan.dest_base.resize(dests.size());
  std::vector<std::tuple<uintptr_t, uintptr_t, std::string>> ranges;
  ranges.reserve(dests.size() + 1);
  auto add_range = [&](const at::Tensor& t, std::string name) {
    const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
    ranges.emplace_back(start, start + t.numel() * t.element_size(), std::move(name));
  };
  if (gathered.numel() > 0) add_range(gathered, "gathered");
  size_t k = 0;
  for (size_t i = 0; i < slice_numels.size(); ++i) {
    const int64_t s = slice_numels[i];
    for (int64_t j = 0; j < chunk_counts[i]; ++j, ++k) {
      const at::Tensor& d = dests[k];
      const std::string name = "dests[" + std::to_string(k) + "]";
      TORCH_CHECK_VALUE(d.defined(), op, ": ", name, " is undefined");
      TORCH_CHECK_VALUE(d.scalar_type() == gathered.scalar_type(), op, ": ", name, " has dtype ",
                        d.scalar_type(), " but gathered has dtype ", gathered.scalar_type());
      TORCH_CHECK_VALUE(d.device() == gathered.device(), op, ": ", name, " is on device ",
                        d.device(), " but gathered is on ", gathered.device());
      TORCH_CHECK_VALUE(d.is_contiguous(), op, ": ", name, " must be contiguous");
      TORCH_CHECK_VALUE(d.numel() > 0 && d.numel() <= world_size * s, op, ": ", name, " (chunk ", j,
                        " of weight ", i, ") has ", d.numel(),
                        " elements; a chunk has between 1 and world_size * slice_numels[", i,
                        "] = ", world_size * s, " elements");
      plan.dest_weight[k] = static_cast<int64_t>(i);
      plan.dest_base[k] = layout::chunk_base(seg_offset[i], j, s);
      add_range(d, name);
    }
  }
  check_no_overlap(op, std::move(ranges));
  return plan;
}

namespace {

bool dequant_dtype_ok(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The Python dtype name, so both impls print the same message.
std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// elastic_kernels/quant/_common.py check_block and blob.py chunk_formats (the format's name
// prefixes its messages): any shape (blocks run over the flattened weight), but every chunk
// but the last holds whole blocks.
void check_block(const char* op, const char* fmt, int64_t rows, int64_t cols,
                 int64_t rows_per_chunk, int64_t block) {
  TORCH_CHECK_VALUE(quant::valid_block_size(block), op, ": ", fmt,
                    ": block_size must be a power of two between ", quant::kMinBlock, " and ",
                    quant::kMaxBlock, ", got ", block);
  TORCH_CHECK_VALUE(rows_per_chunk >= rows || (rows_per_chunk * cols) % block == 0, op, ": ", fmt,
                    ": weight shape (", rows, ", ", cols, ") in chunks of ", rows_per_chunk,
                    " rows: a chunk of ", rows_per_chunk * cols,
                    " weights is not a whole number of blocks of ", block,
                    "; a chunk holds whole blocks (only the weight's last may end in a partial "
                    "one), so rows_per_chunk must be a multiple of ", block / std::gcd(cols, block),
                    " (block / gcd(row length, block)) or at least ", rows);
}

}  // namespace

DequantPlan check_dequant_args(const char* op, at::TensorList blobs, c10::string_view format,
                               int64_t rows, int64_t cols, int64_t rows_per_chunk,
                               int64_t block_size, bool nested,
                               std::optional<at::ScalarType> dtype, const at::Tensor* out) {
  DequantPlan plan;
  const int64_t n = static_cast<int64_t>(blobs.size());
  TORCH_CHECK_VALUE(n > 0, op, ": blobs must not be empty (one blob per chunk)");
  TORCH_CHECK_VALUE(format == "nf4" || format == "int8", op,
                    ": format must be one of ('nf4', 'int8'), got '", std::string(format), "'");
  plan.format = format == "nf4" ? quant::Format::kNF4 : quant::Format::kInt8;
  const std::pair<const char*, int64_t> ints[] = {
      {"rows", rows}, {"cols", cols}, {"rows_per_chunk", rows_per_chunk}, {"block_size", block_size}};
  for (const auto& [name, v] : ints) {
    TORCH_CHECK_VALUE(v >= 1, op, ": ", name, " must be >= 1, got ", v);
  }
  TORCH_CHECK_VALUE((n - 1) * rows_per_chunk < rows && rows <= n * rows_per_chunk, op, ": ", n,
                    " blobs of rows_per_chunk = ", rows_per_chunk, " rows hold ",
                    (n - 1) * rows_per_chunk + 1, " to ", n * rows_per_chunk, " rows, but rows = ",
                    rows, " (every chunk but the last is full)");
  if (plan.format == quant::Format::kNF4) {
    check_block(op, "nf4", rows, cols, rows_per_chunk, block_size);
  } else {
    TORCH_CHECK_VALUE(!nested, op, ": nested (double quantization of the scales) is an NF4 option; "
                      "int8 has no nested scales");
    check_block(op, "int8", rows, cols, rows_per_chunk, block_size);
  }
  plan.cols = cols;
  plan.block = block_size;
  plan.nested = nested;
  plan.rows_per_chunk = rows_per_chunk;
  plan.last_rows = rows - (n - 1) * rows_per_chunk;
  plan.full = quant::blob_layout(plan.format, std::min(rows_per_chunk, rows), cols, block_size, nested);
  plan.last = quant::blob_layout(plan.format, plan.last_rows, cols, block_size, nested);

  const at::Tensor& first = blobs[0];
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& b = blobs[i];
    const std::string name = "blobs[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(b.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK_TYPE(b.scalar_type() == at::kByte, op, ": ", name, " has dtype ",
                     py_dtype(b.scalar_type()), "; a blob is bytes (torch.uint8)");
    TORCH_CHECK_VALUE(b.device() == first.device(), op, ": ", name, " is on device ", b.device(),
                      " but blobs[0] is on ", first.device(), "; all blobs must be on one device");
    TORCH_CHECK_VALUE(b.dim() == 1, op, ": ", name, " must be 1-D (one chunk's bytes), got shape ",
                      b.sizes());
    TORCH_CHECK_VALUE(b.is_contiguous(), op, ": ", name, " must be contiguous");
    const bool is_last = i == n - 1;
    const int64_t want = is_last ? plan.last.total : plan.full.total;
    TORCH_CHECK_VALUE(b.numel() == want, op, ": ", name, " has ", b.numel(), " bytes but the ",
                      std::string(format), " blob of its chunk (",
                      is_last ? plan.last_rows : rows_per_chunk, " x ", cols, " weights, block ",
                      block_size, nested ? ", nested" : "", ") has ", want);
  }
  if (out == nullptr) {
    TORCH_CHECK_TYPE(dtype.has_value() && dequant_dtype_ok(*dtype), op,
                     ": dtype must be torch.float32, torch.bfloat16 or torch.float16 (the compute "
                     "dtype), got ", dtype.has_value() ? py_dtype(*dtype) : std::string("None"));
    return plan;
  }
  const at::Tensor& o = *out;
  TORCH_CHECK_VALUE(o.defined(), op, ": out is undefined");
  TORCH_CHECK_TYPE(dequant_dtype_ok(o.scalar_type()), op,
                   ": out's dtype must be torch.float32, torch.bfloat16 or torch.float16 (the "
                   "compute dtype), got ", py_dtype(o.scalar_type()));
  TORCH_CHECK_VALUE(o.device() == first.device(), op, ": out is on device ", o.device(),
                    " but blobs[0] is on ", first.device());
  TORCH_CHECK_VALUE(o.dim() == 2 && o.size(0) == rows && o.size(1) == cols, op,
                    ": out must have shape [rows, cols] = [", rows, ", ", cols, "], got ", o.sizes());
  TORCH_CHECK_VALUE(o.is_contiguous(), op, ": out must be contiguous");
  const auto lo = reinterpret_cast<uintptr_t>(o.data_ptr());
  const auto hi = lo + o.numel() * o.element_size();
  for (int64_t i = 0; i < n; ++i) {
    const auto b0 = reinterpret_cast<uintptr_t>(blobs[i].data_ptr());
    TORCH_CHECK_VALUE(!(b0 < hi && lo < b0 + blobs[i].numel()), op, ": out and blobs[", i,
                      "] overlap in memory; out must have memory of its own");
  }
  return plan;
}

namespace {

// pack_shards([]) has no tensor, so the dispatcher has no device to pick a kernel by: it runs
// the CompositeExplicitAutograd kernel, which is also what a device without a kernel of its own
// gets. Either way the arguments are checked first, so the error names the argument at fault.
at::Tensor pack_shards_no_kernel(at::TensorList shards, c10::IntArrayRef slice_numels,
                                 c10::IntArrayRef chunk_begins, c10::IntArrayRef chunk_ends) {
  check_pack_args(shards, slice_numels, chunk_begins, chunk_ends);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "elastic::pack_shards has no kernel for device ",
                              shards[0].device());
}

// dequant_chunks([]) likewise: no tensor, no device.
at::Tensor dequant_chunks_no_kernel(at::TensorList blobs, c10::string_view format, int64_t rows,
                                    int64_t cols, int64_t rows_per_chunk, int64_t block_size,
                                    bool nested, at::ScalarType dtype) {
  check_dequant_args("elastic::dequant_chunks", blobs, format, rows, cols, rows_per_chunk,
                     block_size, nested, dtype, nullptr);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "elastic::dequant_chunks has no kernel for device ",
                              blobs[0].device(), " (CUDA tensors run the Triton op "
                              "elastic::dequant_chunks_triton)");
}

}  // namespace
}  // namespace elastic

TORCH_LIBRARY(elastic, m) {
  // Fake (meta) impls of these ops are registered from this Python module.
  m.set_python_module("elastic_kernels.ops.pack");
  // Copy the slices of chunks [chunk_begins[i], chunk_ends[i]) of every shard into one new 1-D
  // send buffer, weight after weight (layout.py [Note: chunk-major shard layout]).
  m.def(
      "pack_shards(Tensor[] shards, int[] slice_numels, int[] chunk_begins, int[] chunk_ends) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Write a rank-major all-gather of pack_shards outputs into one destination per chunk,
  // dropping the padding of ragged chunks.
  m.def(
      "unpack_gathered(Tensor gathered, int world_size, int[] slice_numels, int[] chunk_counts, "
      "Tensor(a!)[] dests) -> ()",
      {at::Tag::pt2_compliant_tag});

  // Fake impls of the dequant ops are registered from their own module.
  m.set_python_module("elastic_kernels.ops.dequant");
  // The weight [rows, cols] in `dtype` held by a weight's chunk blobs, one 1-D uint8 blob per
  // chunk of rows_per_chunk rows (the last may be ragged): elastic_kernels/quant/blob.py
  // [Note: quantized chunk blob]; format "nf4" (bitsandbytes' NF4, `nested` scales) or "int8".
  m.def(
      "dequant_chunks(Tensor[] blobs, str format, int rows, int cols, int rows_per_chunk, "
      "int block_size, bool nested, ScalarType dtype) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // The same, written into out [rows, cols] (contiguous; its dtype is the compute dtype).
  m.def(
      "dequant_chunks_into(Tensor[] blobs, str format, int rows, int cols, int rows_per_chunk, "
      "int block_size, bool nested, Tensor(a!) out) -> ()",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(elastic, CompositeExplicitAutograd, m) {
  m.impl("pack_shards", &elastic::pack_shards_no_kernel);
  m.impl("dequant_chunks", &elastic::dequant_chunks_no_kernel);
}
