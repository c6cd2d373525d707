"""elastic::pack_shards / elastic::unpack_gathered: every impl (C++ CPU, CUDA, Triton, reference)
against the layout's own truth, bit for bit.

Truth is independent of every impl: shards come from `ChunkLayout.shard`, and an unpack of the
all-gather of every rank's pack (simulated by stacking the packs) must give back exactly the
rows `ChunkLayout.chunk_rows` names. Weights are random *bits*, so NaN payloads, -0.0 and
subnormals are in the data and any value conversion would show. Destinations are views into a
sentinel-filled buffer, so a write past a dest's end (e.g. of a ragged chunk's padding) shows.

A new op in the `elastic::` namespace must get an entry in OP_TESTS (reference, opcheck
samples); test_every_elastic_op_is_covered fails until it has one and a fake impl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import elastic_kernels
from elastic_kernels import ChunkLayout
from elastic_kernels.ops import pack, pack_triton, register_triton_ops
from elastic_kernels.ops.pack_reference import pack_shards_reference, unpack_gathered_reference
from tests import _skips

# The tests reach the Triton ops as torch.ops.elastic.*, which exist once registered: they register
# on first need ([Note: Triton ops register lazily] in elastic_kernels/ops/_lazy.py).
register_triton_ops()

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8]
WORLD_SIZES = [1, 2, 3, 4, 5, 8]
SENTINEL = 0xA5

# Weights of one (possibly coalesced) gather: (rows, cols, rows_per_chunk, chunk range kind).
# Ragged: rows % rows_per_chunk != 0; chunk_numel % world_size != 0 for most world sizes.
CASES = {
    "even": [(16, 4, 4, "all")],  # chunk_numel 16: no padding for W in 1, 2, 4, 8
    "ragged": [(7, 5, 3, "all")],  # last chunk 1 row; chunk_numel 15
    "coalesced_partial": [(7, 5, 3, "tail"), (4, 3, 4, "all"), (10, 1, 3, "mid"), (9, 6, 2, "none")],
    "tiny": [(1, 1, 1, "all"), (3, 2, 5, "all"), (5, 3, 1, "head")],  # chunks smaller than W
    "long_runs": [(300, 100, 128, "all")],  # runs of up to 6400 elements: several tiles/programs
}
# Over 1 MiB per call: the C++ CPU impl's multi-threaded path [Note: CPU copies] (cpp only).
LARGE_CASE = [(1000, 1100, 300, "all"), (513, 700, 64, "tail")]


def _chunk_range(kind: str, n: int) -> tuple[int, int]:
    return {
        "all": (0, n),
        "head": (0, max(1, n // 2)),
        "tail": (n // 2, n),
        "mid": (min(1, n - 1), max(min(1, n - 1), n - 1)),
        "none": (n // 2, n // 2),
    }[kind]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (on CPU), so NaN payloads and -0.0 compare exactly."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def random_bits(shape, dtype, gen) -> torch.Tensor:
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


@dataclass
class Scenario:
    world_size: int
    layouts: list[ChunkLayout]
    weights: list[torch.Tensor]
    shards: list[list[torch.Tensor]]  # shards[rank][weight], on CPU
    begins: list[int]
    ends: list[int]

    @property
    def slice_numels(self):
        return [lay.slice_numel for lay in self.layouts]

    @property
    def counts(self):
        return [e - b for b, e in zip(self.begins, self.ends)]

    def chunk_truths(self):
        """(shape, rows of the original weight) of every unpacked chunk, in dest order."""
        for lay, w, b, e in zip(self.layouts, self.weights, self.begins, self.ends):
            for c in range(b, e):
                r0, r1 = lay.chunk_rows(c)
                yield lay.chunk_shape(c), w[r0:r1]


def scenario(case: str, world_size: int, dtype, seed: int = 0) -> Scenario:
    gen = torch.Generator().manual_seed(seed)
    layouts, weights, begins, ends = [], [], [], []
    for rows, cols, rpc, kind in CASES[case] if case in CASES else LARGE_CASE:
        lay = ChunkLayout(rows, cols, rpc, world_size)
        layouts.append(lay)
        weights.append(random_bits((rows, cols), dtype, gen))
        b, e = _chunk_range(kind, lay.num_chunks)
        begins.append(b)
        ends.append(e)
    shards = [[lay.shard(w, r) for lay, w in zip(layouts, weights)] for r in range(world_size)]
    return Scenario(world_size, layouts, weights, shards, begins, ends)


def sentinel_dests(shapes, dtype, device, gap: int):
    """Dests as views into one buffer filled with SENTINEL bytes, `gap` elements apart (and
    before the first and after the last); returns (buffer, dests, mask of the gap elements)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(s) for s in shapes]
    total = sum(sizes) + gap * (len(sizes) + 1)
    buf = torch.full((total * itemsize,), SENTINEL, dtype=torch.uint8, device=device).view(dtype)
    in_gap = torch.ones(total, dtype=torch.bool)
    dests, pos = [], gap
    for shape, n in zip(shapes, sizes):
        dests.append(buf[pos : pos + n].view(shape))
        in_gap[pos : pos + n] = False
        pos += n + gap
    return buf, dests, in_gap


def impl_fns(impl: str, device: str = "cpu"):
    """(pack, unpack) callables of one impl, called the way its users call it."""
    if impl == "reference":
        return pack_shards_reference, unpack_gathered_reference
    if impl == "cpp":
        _skips.require_ext()
        return torch.ops.elastic.pack_shards, torch.ops.elastic.unpack_gathered
    if impl == "triton":
        if device == "cpu":
            _skips.require_triton_on_cpu()
        return torch.ops.elastic.pack_shards_triton, torch.ops.elastic.unpack_gathered_triton
    raise AssertionError(impl)


def check_roundtrip(impl: str, case: str, world_size: int, dtype, device: str = "cpu", gap: int = 3):
    pack, unpack = impl_fns(impl, device)
    sc = scenario(case, world_size, dtype)
    packs = []
    for r in range(world_size):
        shards = [s.to(device) for s in sc.shards[r]]
        p = pack(shards, sc.slice_numels, sc.begins, sc.ends)
        expected = pack_shards_reference(sc.shards[r], sc.slice_numels, sc.begins, sc.ends)
        assert p.device.type == device and p.dim() == 1
        assert bits_equal(p, expected), f"rank {r}: {impl} pack differs from the reference"
        assert all(bits_equal(s, s0) for s, s0 in zip(shards, sc.shards[r])), "pack wrote to a shard"
        packs.append(p)
    # the all-gather's output, both accepted shapes: [world_size, per_rank] and flat
    gathered = torch.stack(packs) if world_size % 2 else torch.cat(packs)
    gathered_before = gathered.clone()
    shapes, truths = zip(*sc.chunk_truths()) if sum(sc.counts) else ((), ())
    buf, dests, in_gap = sentinel_dests(shapes, dtype, device, gap)
    unpack(gathered, world_size, sc.slice_numels, sc.counts, dests)
    for k, (d, truth) in enumerate(zip(dests, truths)):
        assert bits_equal(d, truth), f"dest {k}: {impl} unpack differs from the weight's chunk"
    assert bool((raw(buf).view(-1, buf.element_size())[in_gap] == SENTINEL).all()), "write outside the dests"
    assert bits_equal(gathered, gathered_before), "unpack wrote to gathered"


# ---------------------------------------------------------------------------------------------
# Parity: every impl against the layout's truth (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_roundtrip(impl, world_size, case, dtype):
    check_roundtrip(impl, case, world_size, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_roundtrip_large_cpp(world_size, threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_roundtrip("cpp", "large", world_size, torch.float32)
    finally:
        torch.set_num_threads(prev)


# The interpreter runs every Triton program in Python: a subset of the product, every case.
@pytest.mark.parametrize(
    "world_size,dtype",
    [(1, torch.float32), (2, torch.bfloat16), (3, torch.int8), (5, torch.float16), (8, torch.uint8)],
    ids=str,
)
@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_triton(case, world_size, dtype):
    check_roundtrip("triton", case, world_size, dtype)


def _random_unpack_inputs(case, world_size, dtype, seed=1):
    """A gathered buffer of random bits (junk where padding would be) and its dest shapes."""
    sc = scenario(case, world_size, dtype, seed)
    per_rank = sum(c * s for c, s in zip(sc.counts, sc.slice_numels))
    gathered = random_bits((world_size * per_rank,), dtype, torch.Generator().manual_seed(seed + 1))
    shapes = [shape for shape, _ in sc.chunk_truths()]
    return sc, gathered, shapes


@pytest.mark.parametrize("impl", ["cpp", "triton"])
@pytest.mark.parametrize("world_size", [3, 8])
@pytest.mark.parametrize("case", ["ragged", "coalesced_partial", "tiny"])
def test_unpack_random_bits_matches_reference(impl, case, world_size):
    """Unpack of arbitrary bits (not zeros in the padding) agrees with the reference, bitwise."""
    _, unpack = impl_fns(impl)
    sc, gathered, shapes = _random_unpack_inputs(case, world_size, torch.bfloat16)
    _, want, _ = sentinel_dests(shapes, torch.bfloat16, "cpu", 0)
    unpack_gathered_reference(gathered, world_size, sc.slice_numels, sc.counts, want)
    buf, got, in_gap = sentinel_dests(shapes, torch.bfloat16, "cpu", 2)
    unpack(gathered, world_size, sc.slice_numels, sc.counts, got)
    assert all(bits_equal(g, w) for g, w in zip(got, want))
    assert bool((raw(buf).view(-1, 2)[in_gap] == SENTINEL).all())


@pytest.mark.parametrize("impl", ["reference", "cpp", "triton"])
def test_empty_ranges_and_no_dests(impl):
    pack, unpack = impl_fns(impl)
    shards = [torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.float32)]
    out = pack(shards, [3, 2], [1, 2], [1, 2])
    assert out.shape == (0,) and out.dtype == torch.float32
    unpack(torch.empty(0), 4, [3, 2], [0, 0], [])  # nothing to do, and no error


def test_pack_returns_fresh_memory():
    _skips.require_ext()
    shard = torch.arange(12, dtype=torch.float32)
    out = torch.ops.elastic.pack_shards([shard], [4], [0], [3])
    assert out.data_ptr() != shard.data_ptr()
    out.zero_()
    assert torch.equal(shard, torch.arange(12, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# The user-facing functions (elastic_kernels.ops) and their dispatch [Note: which impl runs]
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["auto", "cpp", "triton", "reference"])
def test_user_functions(impl):
    if impl == "cpp":
        _skips.require_ext()
    if impl == "triton":
        _skips.require_triton_on_cpu()
    sc = scenario("coalesced_partial", 3, torch.float16)
    packs = [
        elastic_kernels.pack_shards(sc.shards[r], sc.slice_numels, sc.begins, sc.ends, impl=impl) for r in range(3)
    ]
    shapes, truths = zip(*sc.chunk_truths())
    dests = [torch.empty(s, dtype=torch.float16) for s in shapes]
    assert elastic_kernels.unpack_gathered(torch.stack(packs), 3, sc.slice_numels, sc.counts, dests, impl=impl) is None
    assert all(bits_equal(d, t) for d, t in zip(dests, truths))


def test_auto_picks_cpp_on_cpu_when_built():
    from elastic_kernels import _ext

    expected = "cpp" if _ext.available() else "reference"
    assert pack._resolve("auto", torch.device("cpu")) == expected
    if _ext.available() and _ext.cuda_built():
        assert pack._resolve("auto", torch.device("cuda")) == "cpp"


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="impl must be one of"):
        elastic_kernels.pack_shards([torch.zeros(4)], [2], [0], [2], impl="fast")
    with pytest.raises(ValueError, match="impl must be one of"):
        elastic_kernels.unpack_gathered(torch.zeros(4), 1, [2], [2], [torch.zeros(2)] * 2, impl="fast")


def test_user_functions_name_bad_argument_types():
    with pytest.raises(ValueError, match=r"shards must be a sequence of tensors, got Tensor"):
        elastic_kernels.pack_shards(torch.zeros(4), [2], [0], [2])
    with pytest.raises(ValueError, match=r"chunk_ends\[0\] must be an int, got float"):
        elastic_kernels.pack_shards([torch.zeros(4)], [2], [0], [2.0])
    with pytest.raises(ValueError, match=r"dests\[1\] must be a tensor, got NoneType"):
        elastic_kernels.unpack_gathered(torch.zeros(4), 1, [2], [2], [torch.zeros(2), None])
    with pytest.raises(ValueError, match=r"gathered must be a tensor, got list"):
        elastic_kernels.unpack_gathered([1.0], 1, [2], [2], [])


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    _skips.require_triton_on_cpu()
    monkeypatch.setattr(pack_triton, "_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        pack_triton.pack_shards_triton([torch.zeros(4)], [2], [0], [2])


# ---------------------------------------------------------------------------------------------
# Bad input: each impl raises ValueError naming the argument
# ---------------------------------------------------------------------------------------------

f32, f16 = torch.float32, torch.float16


def _z(n, dtype=f32, device="cpu"):
    return torch.zeros(n, dtype=dtype, device=device)


# (shards, slice_numels, chunk_begins, chunk_ends), pattern the message must match
BAD_PACK = {
    "dtype": (([_z(6), _z(6, f16)], [3, 3], [0, 0], [2, 2]), r"shards\[1\] has dtype"),
    "device": (([_z(6), _z(6, device="meta")], [3, 3], [0, 0], [2, 2]), r"shards\[1\] is on device"),
    "not_1d": (([torch.zeros(2, 3)], [3], [0], [2]), r"shards\[0\] must be 1-D"),
    "non_contiguous": (([_z(12)[::2]], [3], [0], [2]), r"shards\[0\] must be contiguous"),
    "not_divisible": (([_z(7)], [3], [0], [2]), r"shards\[0\] has 7 elements, not a multiple of slice_numels\[0\]"),
    "slice_zero": (([_z(6)], [0], [0], [0]), r"slice_numels\[0\] must be >= 1"),
    "end_past_chunks": (([_z(6), _z(6)], [3, 3], [0, 0], [2, 3]), r"chunk_ends\[1\]\) = \[0, 3\) is not within"),
    "begin_after_end": (([_z(6)], [3], [2], [1]), r"chunk_begins\[0\].* = \[2, 1\) is not within"),
    "negative_begin": (([_z(6)], [3], [-1], [1]), r"chunk_begins\[0\].* is not within"),
    "lengths": (([_z(6), _z(6)], [3], [0, 0], [2, 2]), r"slice_numels has 1 entries but shards has 2"),
    "lengths_ends": (([_z(6), _z(6)], [3, 3], [0, 0], [2]), r"chunk_ends has 1 entries but shards has 2"),
    "empty": (([], [], [], []), r"shards must not be empty"),
    "elem_size": (([torch.zeros(6, dtype=torch.complex128)], [3], [0], [2]), r"shards\[0\] has dtype .*16-byte"),
}


def _gathered(world_size=2, per_rank=7, dtype=f32, device="cpu"):
    return torch.zeros(world_size * per_rank, dtype=dtype, device=device)


def _overlapping_dests():
    buf = _z(12)
    return [buf[0:6], buf[4:10]]  # world_size 2, slice_numels [3]: chunks of <= 6 elements


def _dest_overlapping_gathered():
    g = _gathered(2, 3)  # world_size 2, slice_numels [3], chunk_counts [1]: one dest of <= 6
    return g, 2, [3], [1], [g[1:4]]


# (gathered, world_size, slice_numels, chunk_counts, dests), pattern.
# Valid shape: world_size 2, slice_numels [3, 1], chunk_counts [2, 1] -> per_rank 7, 3 dests.
def _ok_dests(dtype=f32, device="cpu"):
    return [_z(6, dtype, device), _z(5, dtype, device), _z(2, dtype, device)]


BAD_UNPACK = {
    "world_size": (lambda: (_gathered(), 0, [3, 1], [2, 1], _ok_dests()), r"world_size must be >= 1, got 0"),
    "gathered_numel": (lambda: (_gathered(2, 6), 2, [3, 1], [2, 1], _ok_dests()), r"gathered has 12 elements but world_size \* per_rank"),
    "gathered_world": (lambda: (_z(21).view(3, 7), 2, [3, 1], [2, 1], _ok_dests()), r"gathered must be 1-D or \[world_size, per_rank\]"),
    "gathered_non_contiguous": (lambda: (_z(28)[::2], 2, [3, 1], [2, 1], _ok_dests()), r"gathered must be contiguous"),
    "gathered_elem_size": (lambda: (torch.zeros(14, dtype=torch.complex128), 2, [3, 1], [2, 1], _ok_dests()), r"gathered has dtype .*16-byte"),
    "lengths": (lambda: (_gathered(), 2, [3, 1], [2], _ok_dests()), r"chunk_counts has 1 entries but slice_numels has 2"),
    "count_negative": (lambda: (_gathered(2, 0), 2, [3], [-1], []), r"chunk_counts\[0\] must be >= 0"),
    "slice_zero": (lambda: (_gathered(2, 0), 2, [0], [0], []), r"slice_numels\[0\] must be >= 1"),
    "num_dests": (lambda: (_gathered(), 2, [3, 1], [2, 1], _ok_dests()[:2]), r"dests has 2 tensors but sum\(chunk_counts\) = 3"),
    "dest_dtype": (lambda: (_gathered(), 2, [3, 1], [2, 1], [_z(6), _z(5, f16), _z(2)]), r"dests\[1\] has dtype"),
    "dest_device": (lambda: (_gathered(), 2, [3, 1], [2, 1], [_z(6), _z(5), _z(2, device="meta")]), r"dests\[2\] is on device"),
    "dest_too_large": (lambda: (_gathered(), 2, [3, 1], [2, 1], [_z(7), _z(5), _z(2)]), r"dests\[0\] \(chunk 0 of weight 0\) has 7 elements"),
    "dest_empty": (lambda: (_gathered(), 2, [3, 1], [2, 1], [_z(6), _z(5), _z(0)]), r"dests\[2\] \(chunk 0 of weight 1\) has 0 elements"),
    "dest_non_contiguous": (lambda: (_gathered(), 2, [3, 1], [2, 1], [_z(6), _z(10)[::2], _z(2)]), r"dests\[1\] must be contiguous"),
    "dests_overlap": (lambda: (_gathered(2, 6), 2, [3], [2], _overlapping_dests()), r"dests\[0\] and dests\[1\] overlap"),
    "dest_overlaps_gathered": (_dest_overlapping_gathered, r"(gathered and dests\[0\]|dests\[0\] and gathered) overlap"),
}


@pytest.mark.parametrize("impl", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("bad", list(BAD_PACK))
def test_pack_bad_input(impl, bad):
    pack, _ = impl_fns(impl)
    args, pattern = BAD_PACK[bad]
    with pytest.raises(ValueError, match=pattern):
        pack(*args)


@pytest.mark.parametrize("impl", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("bad", list(BAD_UNPACK))
def test_unpack_bad_input(impl, bad):
    _, unpack = impl_fns(impl)
    make, pattern = BAD_UNPACK[bad]
    with pytest.raises(ValueError, match=pattern):
        unpack(*make())


def test_bad_input_leaves_dests_untouched():
    """Checks run before any write: a bad last dest means no dest is written."""
    _skips.require_ext()
    g = torch.ones(14)
    dests = [_z(6), _z(5), _z(0)]
    with pytest.raises(ValueError):
        torch.ops.elastic.unpack_gathered(g, 2, [3, 1], [2, 1], dests)
    assert all(bool((d == 0).all()) for d in dests)


# ---------------------------------------------------------------------------------------------
# opcheck (schema, fake impl, autograd registration, AOT dispatch) and namespace coverage
# ---------------------------------------------------------------------------------------------


def _pack_samples():
    a = scenario("coalesced_partial", 3, torch.float32)
    b = scenario("tiny", 2, torch.bfloat16)
    return [
        (a.shards[1], a.slice_numels, a.begins, a.ends),
        (b.shards[0], b.slice_numels, b.begins, b.ends),
        ([torch.arange(12, dtype=torch.uint8)], [4], [1], [3]),
    ]


def _unpack_samples():
    out = []
    for case, world_size, dtype, flat in [("coalesced_partial", 3, torch.float32, False), ("ragged", 4, torch.bfloat16, True)]:
        sc, gathered, shapes = _random_unpack_inputs(case, world_size, dtype)
        if not flat:
            gathered = gathered.view(world_size, -1)
        out.append((gathered, world_size, sc.slice_numels, sc.counts, [torch.empty(s, dtype=dtype) for s in shapes]))
    return out


# Every op of the elastic:: namespace: its reference and opcheck samples (a new op adds a row).
OP_TESTS = {
    "pack_shards": dict(reference=pack_shards_reference, samples=_pack_samples, needs_ext=True),
    "unpack_gathered": dict(reference=unpack_gathered_reference, samples=_unpack_samples, needs_ext=True),
    "pack_shards_triton": dict(reference=pack_shards_reference, samples=_pack_samples, needs_ext=False),
    "unpack_gathered_triton": dict(reference=unpack_gathered_reference, samples=_unpack_samples, needs_ext=False),
}


@pytest.mark.parametrize("op_name", list(OP_TESTS))
def test_opcheck(op_name):
    entry = OP_TESTS[op_name]
    if entry["needs_ext"]:
        _skips.require_ext()
    else:
        _skips.require_triton_on_cpu()
    op = getattr(torch.ops.elastic, op_name)
    for args in entry["samples"]():
        torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA kernel and Triton compiled for the device, against the same truth
# ---------------------------------------------------------------------------------------------

GPU_PARAMS = [(w, c, d) for w in (1, 3, 8) for c in CASES for d in (torch.float32, torch.bfloat16, torch.uint8)]


@pytest.mark.gpu
@pytest.mark.parametrize("gap", [0, 3])
@pytest.mark.parametrize("world_size,case,dtype", GPU_PARAMS, ids=str)
@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_gpu_roundtrip(impl, world_size, case, dtype, gap):
    if impl == "cpp":
        _skips.require_cuda_ext()
    check_roundtrip(impl, case, world_size, dtype, device="cuda", gap=gap)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_gpu_roundtrip_other_dtypes(impl, world_size, dtype):
    if impl == "cpp":
        _skips.require_cuda_ext()
    check_roundtrip(impl, "coalesced_partial", world_size, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1024, 1003])
@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_gpu_misaligned_and_large(impl, offset, cols):
    """Every copy width of the CUDA kernel: uint8 shards and dests at byte `offset` into larger
    buffers give 16/1/2/4/8-byte units with cols=1024 (slices of 64 KiB: four tiles per run, the
    last run of the ragged last chunk 40 KiB, so one tile of it is past its end); cols=1003
    makes every slice odd-sized (1-byte units throughout)."""
    if impl == "cpp":
        _skips.require_cuda_ext()
    pack, unpack = impl_fns(impl, "cuda")
    world_size = 4
    lay = ChunkLayout(rows=1000, cols=cols, rows_per_chunk=256, world_size=world_size)  # ragged
    gen = torch.Generator().manual_seed(offset)
    weight = random_bits((lay.rows, lay.cols), torch.uint8, gen)
    packs = []
    for r in range(world_size):
        store = torch.zeros(lay.shard_numel + offset, dtype=torch.uint8, device="cuda")
        shard = store[offset:]
        shard.copy_(lay.shard(weight, r))
        p = pack([shard], [lay.slice_numel], [0], [lay.num_chunks])
        assert bits_equal(p, lay.shard(weight, r))
        packs.append(p)
    gathered = torch.cat(packs)
    shapes = [lay.chunk_shape(c) for c in range(lay.num_chunks)]
    buf, dests, in_gap = sentinel_dests(shapes, torch.uint8, "cuda", gap=offset)
    unpack(gathered, world_size, [lay.slice_numel], [lay.num_chunks], dests)
    for c, d in enumerate(dests):
        r0, r1 = lay.chunk_rows(c)
        assert bits_equal(d, weight[r0:r1])
    assert bool((raw(buf)[in_gap] == SENTINEL).all())


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OP_TESTS))
def test_gpu_opcheck(op_name):
    if OP_TESTS[op_name]["needs_ext"]:
        _skips.require_cuda_ext()
    op = getattr(torch.ops.elastic, op_name)

    def to_cuda(x):
        if isinstance(x, torch.Tensor):
            return x.cuda()
        if isinstance(x, (list, tuple)):
            return type(x)(to_cuda(v) for v in x)
        return x

    for args in OP_TESTS[op_name]["samples"]():
        torch.library.opcheck(op, to_cuda(args))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cpp", "triton"])
def test_gpu_device_mismatch_is_named(impl):
    if impl == "cpp":
        _skips.require_cuda_ext()
    pack, unpack = impl_fns(impl, "cuda")
    with pytest.raises(ValueError, match=r"shards\[1\] is on device cpu"):
        pack([_z(6, device="cuda"), _z(6)], [3, 3], [0, 0], [2, 2])
    with pytest.raises(ValueError, match=r"dests\[1\] is on device cpu"):
        unpack(_gathered(device="cuda"), 2, [3, 1], [2, 1], [_z(6, device="cuda"), _z(5), _z(2, device="cuda")])


# ------------------------------------------------------------------ shards without padding

def _own_numel(rows: int, cols: int, rpc: int, world_size: int, rank: int) -> int:
    """Rank `rank`'s real elements (independent of ChunkLayout): full slices of the full chunks,
    then its part of the last chunk, min(S, max(0, L - rank * S))."""
    rpc = min(rpc, rows)
    chunks = -(-rows // rpc)
    s = -(-rpc * cols // world_size)
    last = (rows - (chunks - 1) * rpc) * cols
    return (chunks - 1) * s + min(s, max(0, last - rank * s))


@pytest.mark.parametrize("impl", ["reference", "cpp"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shape", [(7, 5, 3), (1, 1, 1), (3, 2, 5), (127, 7, 8), (33, 24, 8), (16, 4, 4)])
def test_unpadded_shard_sends_what_the_padded_shard_sent(impl, world_size, shape):
    """[Note: chunk-major shard layout]: a shard holds its real elements only (short or empty
    last slice); `shard_from_rows` and `shard` agree; `pad_shard` and `assemble` give back the
    padded shard and the weight; and packing the full part with the last slice zero-padded in a
    temporary (what ElasticTensor.send_parts does) is bit for bit the pack of the padded
    shard, for every chunk range that ends at the last chunk."""
    pack, _ = impl_fns(impl)
    rows, cols, rpc = shape
    lay = ChunkLayout(rows, cols, rpc, world_size)
    gen = torch.Generator().manual_seed(rows * 131 + world_size)
    weight = random_bits((rows, cols), torch.float32, gen)
    n, s = lay.num_chunks, lay.slice_numel
    shards = []
    for r in range(world_size):
        padded = lay.shard(weight, r)
        own = lay.shard(weight, r, padded=False)
        assert own.numel() == lay.own_numel(r) == _own_numel(rows, cols, rpc, world_size, r)
        assert bits_equal(own, padded[: own.numel()]) and bool((raw(padded[own.numel():]) == 0).all())
        assert bits_equal(lay.shard_from_rows(lambda b, e: weight[b:e], r, torch.float32, padded=False), own)
        assert bits_equal(lay.pad_shard(own, r), padded) and lay.pad_shard(padded, r) is padded
        shards.append(own)
        tail = own.new_zeros(s)
        tail[: own.numel() - (n - 1) * s].copy_(own[(n - 1) * s :])
        for begin in range(n):
            sent = pack([own[: (n - 1) * s], tail], [s, s], [min(begin, n - 1), 0], [n - 1, 1])
            assert bits_equal(sent, pack([padded], [s], [begin], [n])), (r, begin)
    assert bits_equal(lay.assemble(shards), weight)
    with pytest.raises(ValueError, match="expected"):
        lay.pad_shard(shards[0][:-1] if shards[0].numel() else shards[0].new_zeros(1), 0)


def test_pack_into_a_kept_buffer():
    """pack_shards(..., out=buf): the same bits as a new send buffer, written into buf (the
    gathers' kept buffers, [Note: receive buffers are reused]); a buffer of another size,
    dtype or layout is refused, never resized."""
    g = torch.Generator().manual_seed(7)
    shards = [torch.randn(40, generator=g), torch.randn(24, generator=g), torch.randn(9, generator=g)]
    args = ([4, 6, 3], [1, 0, 1], [10, 4, 3])
    want = pack_shards_reference(shards, *args)
    buf = torch.full((want.numel(),), float("nan"))
    got = pack.pack_shards(shards, *args, out=buf)
    assert got is buf and torch.equal(buf, want)
    for bad in (torch.empty(want.numel() + 1), torch.empty(want.numel(), dtype=torch.float64),
                torch.empty(2 * want.numel())[::2], torch.empty(want.numel(), 1)):
        with pytest.raises(ValueError, match="out must"):
            pack.pack_shards(shards, *args, out=bad)
