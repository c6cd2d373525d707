"""The planner on a quantized model.

- Bytes: a measured profile's byte counts come from the runtime's tensors
  (python_api/planning/measure.py reads et.slice_bytes / et.page_bytes / the pool's page),
  which are the quantized chunk's, so a plan's predicted all-gather bytes are the measured ones;
  a synthetic profile's are the kernels layer's blob sizes.
- Dequantization ([Note: dequantization in the time model] in python_api/planner/cost.py): the
  measured figure per weight against an independent timing of the op; the step time of a
  quantized profile is the unquantized one's plus the dequant of every use.
- The format is the user's: a plan keeps its profile's, records it in its JSON, and is refused
  by a profile or a model of another format. Documents written before the field load unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import pytest
import torch

from elastic_kernels.api.planner import (
    Choices,
    LayerProfile,
    Link,
    OutsideProfile,
    Plan,
    Profile,
    ProfileError,
    WeightProfile,
    plan_from_profile,
    step_cost,
    synthetic_profile,
)
from elastic_kernels.api.planner.profile import WeightFormat
from elastic_kernels.api.planner.shapes import DEVICES, SHAPES
from tests._dist import run_distributed
from tests.quant._models import quant_llama
from tests.quant.test_runtime_quant import _blob_bytes

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEQ = 12


def _use_seconds(qlayout, dtype, per_chunk: bool) -> float:
    """An independent timing of one use's dequantization of a weight of `qlayout`'s shapes: the
    call the layer makes (python_api/quant `dequantize_use`: one over every chunk, or one per
    chunk for a plain ElasticLinear) on a quantized normal weight, into a workspace of its own;
    the median of 41 single uses. Not the bare kernel: on these 64-wide, 13-chunk
    weights the call's Python work (the chunks' formats, views, the split) is 4-8x the C++
    kernel's time (11 vs 50-97 us, one process on this machine), and every use pays it."""
    from elastic_kernels.api.quant import DequantWorkspace, dequantize_use

    gen = torch.Generator().manual_seed(5)
    blobs = qlayout.blobs(qlayout.quantize(torch.randn(qlayout.rows, qlayout.cols, generator=gen)))
    ws = DequantWorkspace()

    def use():
        if per_chunk:
            for c, b in enumerate(blobs):
                dequantize_use(qlayout, [b], dtype, ws, c)
        else:
            dequantize_use(qlayout, blobs, dtype, ws)

    use()
    times = []
    for _ in range(41):
        t0 = time.perf_counter()
        use()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, reset_stats, stats
    from elastic_kernels.api.nn import ElasticLinear, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.nn.convert import runtime_of
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile

    # lm_head (not a LoRA target) is elastic too: a plain ElasticLinear, which dequantizes per chunk.
    model = convert_to_elastic(quant_llama(), LoRAConfig(r=4, alpha=8, target_modules=TARGETS, seed=3),
                               ElasticPolicy(chunk_bytes=64 * 4 * 5, weight_format="nf4", replicate_below_bytes=0,
                                             quant_skip_modules=()))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.train()
    gen = torch.Generator().manual_seed(100 + rank)
    report: dict = {}
    profile = measure_profile(model, [torch.randint(0, 64, (2, SEQ), generator=gen)], capacity_bytes=1 << 30,
                              report=report)
    sizes = [(w.name, w.chunks, w.slice_bytes, w.chunk_bytes, w.last_chunk_bytes)
             for layer in profile.layers for w in layer.weights]
    # Half of each weight's chunks kept to backward, none across steps (so every step gathers):
    # the planner's prediction from the profile's (quantized) byte counts.
    choices = Choices(micro_batch=2, keep=tuple(tuple(w.chunks // 2 for w in layer.weights) for layer in profile.layers),
                      persist=tuple(tuple(0 for _ in layer.weights) for layer in profile.layers),
                      recompute=tuple(False for _ in profile.layers), prefetch_depth=1)
    plan = plan_of(profile, choices, memory_bytes=1 << 30, global_batch=2 * world_size)
    # A plan for weights stored otherwise is refused before anything changes (no collective yet).
    with pytest.raises(ValueError, match=r"stored unquantized, this model's are stored nf4 \(block 64\)"):
        apply_plan(model, dataclasses.replace(plan, weight_format=None))
    apply_plan(model, plan)
    measured = []
    for _ in range(3):
        batch = torch.randint(0, 64, (plan.accumulation, plan.micro_batch, SEQ), generator=gen)
        reset_stats(model)
        for a in range(plan.accumulation):
            model(input_ids=batch[a], labels=batch[a]).loss.backward()
        measured.append(stats(model)["allgather_bytes"])
    rt = runtime_of(model)
    per_chunk = {m.et.name for m in model.modules() if isinstance(m, ElasticLinear)}
    independent = {et.name: _use_seconds(et.qlayout, torch.float32, et.name in per_chunk) for et in rt.tensors}
    dequant = {w.name: w.dequant_s for layer in profile.layers for w in layer.weights}
    return (sizes, measured, plan.predicted_allgather_bytes_per_step, plan.kept_chunks, plan.total_chunks,
            profile.to_json(), plan.to_json(), dequant, independent, sorted(per_chunk),
            (report["unit_times"], report["tokens"]))


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_plan_on_quantized_weights_predicts_the_measured_bytes_and_times_the_dequant():
    results = run_distributed(_worker, 2, timeout=600)
    sizes, measured, predicted, kept, total, profile_json, plan_json, dequant, _, per_chunk, raw = results[0]
    rows_per_chunk = 5
    for name, chunks, slice_bytes, chunk_bytes, last in sizes:
        cols = 128 if name.endswith("down_proj") else 64
        rpc = rows_per_chunk * 64 // cols  # chunk_bytes = 5 fp32 rows of a 64-wide weight
        assert chunk_bytes == _blob_bytes("nf4", None, False, rpc, cols), name
        assert slice_bytes == -(-chunk_bytes // 2), name
    assert kept < total
    assert measured[1:] == [predicted] * 2 and predicted > 0, (measured, predicted)

    # The profile records the format and a dequant time per weight, and round-trips.
    profile = Profile.from_json(profile_json)
    assert profile.to_json() == profile_json
    assert profile.weight_format == WeightFormat("nf4", 64, False)
    assert json.loads(plan_json)["weight_format"] == {"name": "nf4", "block_size": 64, "nested": False}
    assert Plan.from_json(plan_json).weight_format == profile.weight_format
    assert per_chunk == ["lm_head"]  # the plain ElasticLinear, timed one call per chunk
    # Each weight's figure (the MAX over the ranks of a median of 9 windows of back-to-back
    # uses) against the MAX over the ranks of an independent timing of the same call on the same
    # shapes (median of 41 single uses): positive, and within a factor of 3 either way. Both
    # are wall-clock on a 2-core machine shared by the two ranks and other jobs (ratios seen at
    # load 8: 0.65-2.0); the band still fails on a unit slip (x1000), on a figure that is not
    # one use's, or on the wrong call pattern (one call per chunk for a LoRA weight, or one call
    # for lm_head: 3-5x apart here).
    for name, seconds in dequant.items():
        ref = max(r[8][name] for r in results)
        assert seconds > 0, name
        assert ref / 3 < seconds < 3 * ref, (name, seconds, ref)
    # Not counted twice: the units were timed with their dequantization inside; the profile
    # holds them net of it and the model adds it per use, so at the profiled micro-batch a use's
    # compute is what was measured (a unit measured faster than its dequant alone: the dequant).
    times, T = raw
    assert len(times) == len(profile.layers)
    for layer, (ff, fp, bf, bp) in zip(profile.layers, times):
        assert layer.dequant_fwd_s > 0 and layer.dequant_bwd_s >= 0
        assert layer.fwd_s(T) == pytest.approx(max(ff + fp * T, layer.dequant_fwd_s), rel=1e-9), layer.name
        assert layer.bwd_s(T) == pytest.approx(max(bf + bp * T, layer.dequant_bwd_s), rel=1e-9), layer.name


# ---------------------------------------------------------------- hand profiles: the time model


def _hand(fmt: WeightFormat | None, dq: tuple[float, float, float, float], link: Link) -> Profile:
    """Three units: A (recomputable; wq without a backward use, wo), B (recomputable; wf),
    head (not recomputable; wh). `dq`: each weight's dequant seconds per use (0 with no format)."""
    w = lambda name, n, d, backward=True: WeightProfile(name, n, 500, 1000, backward=backward, dequant_s=d)  # noqa: E731
    return Profile(
        source="hand", device="test", world_size=2, seq_len=10, capacity_bytes=10**7, reserved_bytes=100,
        static_bytes=200, page_bytes=1000, adapter_grad_bytes=1000, allgather=link, allreduce=Link(0.002, 1e6),
        layers=(
            LayerProfile("A", True, 0.01, 0.02, 0.001, 0.002, 10.0, 2.0,
                         (w("wq", 2, dq[0], backward=False), w("wo", 3, dq[1]))),
            LayerProfile("B", True, 0.005, 0.01, 0.0, 0.003, 8.0, 2.0, (w("wf", 4, dq[2]),)),
            LayerProfile("head", False, 0.002, 0.002, 0.0, 0.0, 0.0, 0.0, (w("wh", 1, dq[3]),)),
        ),
        outside=OutsideProfile(1e-4, 1e-4, 1.0, 50.0),
        weight_format=fmt,
    )


def _choices(profile: Profile, kept: bool, recompute: tuple[bool, ...]) -> Choices:
    keep = tuple(tuple(w.chunks if kept else 0 for w in layer.weights) for layer in profile.layers)
    return Choices(micro_batch=2, keep=keep, persist=keep, recompute=recompute, prefetch_depth=1)


DQ = (0.004, 0.003, 0.005, 0.0007)
NF4 = WeightFormat("nf4", 64)


@pytest.mark.parametrize("recompute", [(False, False, False), (True, True, False), (False, True, False)])
def test_step_time_is_the_unquantized_one_plus_the_dequant_of_every_use(recompute):
    fast = Link(0.0, 1e18)
    q = _hand(NF4, DQ, fast)
    u = _hand(None, (0.0,) * 4, fast)
    acc = 3
    # Per micro-batch, by hand: every forward use dequantizes each weight of its unit, a
    # recomputed unit once more, a backward use only its weights with a backward use (not wq).
    wq, wo, wf, wh = DQ
    per_mb = (wq + wo + wf + wh) + recompute[0] * (wq + wo) + recompute[1] * (wf) + (wo + wf + wh)
    for kept in (True, False):  # nothing gathered / everything gathered over a free link
        cq = step_cost(q, _choices(q, kept, recompute), acc)
        cu = step_cost(u, _choices(u, kept, recompute), acc)
        assert cq.step_s == pytest.approx(cu.step_s + acc * per_mb, rel=1e-12, abs=0)
        assert cq.dequant_s == pytest.approx(acc * per_mb, rel=1e-12)
        assert cu.dequant_s == 0.0
        assert cq.exposed_comm_s < 1e-12 and cu.exposed_comm_s < 1e-12  # a free link: nothing waits
    # Over a slow link the dequant lengthens the compute that hides the gathers: the step grows,
    # by at most the dequant term.
    slow = Link(0.001, 2e5)
    cq = step_cost(_hand(NF4, DQ, slow), _choices(q, False, recompute), acc)
    cu = step_cost(_hand(None, (0.0,) * 4, slow), _choices(u, False, recompute), acc)
    assert cu.exposed_comm_s > 0
    assert cu.step_s < cq.step_s <= cu.step_s + acc * per_mb * (1 + 1e-12)


def test_dequant_needs_a_format_and_a_document_round_trips():
    d = json.loads(_hand(NF4, DQ, Link(0.0, 1e9)).to_json())
    assert d["weight_format"] == {"name": "nf4", "block_size": 64, "nested": False}
    assert [w["dequant_s"] for layer in d["layers"] for w in layer["weights"]] == list(DQ)
    assert Profile.from_dict(d) == _hand(NF4, DQ, Link(0.0, 1e9))
    del d["weight_format"]
    with pytest.raises(ProfileError, match=r"weights\[0\] \(wq\)\.dequant_s is 0.004 but profile.weight_format is "
                                           "absent"):
        Profile.from_dict(d)
    d["weight_format"] = {"name": "int8", "block_size": 256, "nested": True}
    with pytest.raises(ProfileError, match="nested is an nf4 option"):
        Profile.from_dict(d)
    d["weight_format"] = {"name": "nf4", "block_size": 48}
    with pytest.raises(ProfileError, match="power of two"):
        Profile.from_dict(d)


# Written by the planner of commit f4b43a4, before weight formats and dequant times existed:
# tests/planner/test_planner.py `tiny_profile().to_json(indent=None)` and a plan of it.
OLD_PROFILE = (
    '{"version": 1, "source": "hand", "device": "test", "world_size": 2, "seq_len": 10, "capacity_bytes": 1000000, '
    '"reserved_bytes": 100, "static_bytes": 200, "page_bytes": 1000, "adapter_grad_bytes": 1000, "allgather": '
    '{"latency_s": 0.001, "bytes_per_s": 5000.0}, "allreduce": {"latency_s": 0.002, "bytes_per_s": 1000000.0}, '
    '"outside": {"fwd_s_per_token": 0.0, "bwd_s_per_token": 0.0, "act_bytes_per_token": 1.0, "peak_bytes_per_token": '
    '50.0, "workspace_bytes_per_token": 0.0, "recompute_workspace_bytes_per_token": 0.0}, "layers": [{"name": "A", '
    '"recomputable": true, "fwd_s_per_token": 0.01, "bwd_s_per_token": 0.02, "fwd_s_fixed": 0.0, "bwd_s_fixed": 0.0, '
    '"act_bytes_per_token": 10.0, "input_bytes_per_token": 2.0, "weights": [{"name": "wa", "chunks": 2, '
    '"slice_bytes": 500, "chunk_bytes": 1000, "backward": true}]}, {"name": "B", "recomputable": false, '
    '"fwd_s_per_token": 0.005, "bwd_s_per_token": 0.01, "fwd_s_fixed": 0.0, "bwd_s_fixed": 0.0, "act_bytes_per_token": '
    '4.0, "input_bytes_per_token": 4.0, "weights": [{"name": "wb", "chunks": 1, "slice_bytes": 300, "chunk_bytes": '
    '600, "backward": true}]}]}'
)
OLD_PLAN = (
    '{"version": 1, "world_size": 2, "memory_bytes": 1000000, "global_batch": 4, "micro_batch": 1, "accumulation": 2, '
    '"prefetch_depth": 1, "pool_budget_bytes": 1000, "predicted_peak_bytes": 7310, '
    '"predicted_allgather_bytes_per_step": 5200, "predicted_step_time_s": 1.631, "planning_seconds": 0.0, '
    '"profile_source": "hand", "host_fraction": 0.0, "offload_activations": false, "predicted_h2d_bytes_per_step": 0, '
    '"layers": [{"name": "A", "recompute": true, "weights": [{"name": "wa", "keep_chunks": 1, "persist_chunks": 0, '
    '"chunks": 2}]}, {"name": "B", "recompute": false, "weights": [{"name": "wb", "keep_chunks": 0, '
    '"persist_chunks": 0, "chunks": 1}]}]}'
)


def test_documents_written_before_weight_formats_load_unquantized():
    from elastic_kernels.api.planner import plan_of

    profile = Profile.from_json(OLD_PROFILE)
    assert profile.weight_format is None
    assert all(w.dequant_s == 0.0 for layer in profile.layers for w in layer.weights)
    assert profile.to_json(indent=None) == OLD_PROFILE  # an unquantized profile writes nothing new
    plan = Plan.from_json(OLD_PLAN)
    assert plan.weight_format is None
    plan.check_profile(profile)
    # The same predictions as when it was written: the dequant term is 0.
    again = plan_of(profile, plan.choices(), memory_bytes=plan.memory_bytes, global_batch=plan.global_batch)
    assert again.predicted_step_time_s == plan.predicted_step_time_s
    assert again.predicted_peak_bytes == plan.predicted_peak_bytes
    assert dataclasses.replace(again, weight_format=None).to_dict() == {**json.loads(OLD_PLAN), "weight_format": None}


# ---------------------------------------------------------------- synthetic profiles and the search


@pytest.mark.parametrize("fmt, block, nested", [("nf4", None, False), ("nf4", None, True), ("int8", 128, False)])
def test_synthetic_quantized_profile_has_the_blobs_and_the_stated_dequant_rate(fmt, block, nested):
    from elastic_kernels.quant import QuantizedLayout

    ranks, device = 8, "h100-sxm"
    p = synthetic_profile("llama2-7b", ranks, 1024, device, weight_format=fmt, quant_block_size=block,
                          quant_nested=nested)
    plain = synthetic_profile("llama2-7b", ranks, 1024, device)
    assert p.weight_format == WeightFormat(fmt, block or {"nf4": 64, "int8": 256}[fmt], nested)
    dev = DEVICES[device]
    rate = 0.8 * dev.hbm_bytes_per_s / 2  # the stated assumption: 80% of the copy bandwidth
    m = SHAPES["llama2-7b"]
    dims = {name: (rows, cols) for name, rows, cols in m.projections()} | {"lm_head": (m.vocab, m.hidden)}
    for layer, base in zip(p.layers, plain.layers):
        for w, b in zip(layer.weights, base.weights):
            rows, cols = dims[w.name]
            rpc = min(rows, (4 << 20) // (2 * cols))  # whole bf16 rows per 4 MiB chunk, as unquantized
            ql = QuantizedLayout(rows, cols, rpc, fmt, block, nested)
            assert (w.chunks, w.chunk_bytes, w.slice_bytes) == (b.chunks, ql.full_blob_bytes,
                                                                -(-ql.full_blob_bytes // ranks)), w.name
            assert w.last_bytes == ql.blob_bytes[-1], w.name
            launches = w.chunks if w.name == "lm_head" else 1
            assert w.dequant_s == pytest.approx(launches * 5e-6 + rows * cols * 2 / rate, rel=1e-12), w.name
    assert p.page_bytes == -(-max(w.chunk_bytes for layer in p.layers for w in layer.weights) // 512) * 512
    # Static: the quantized shards instead of the bf16 ones, plus the dequant workspace (the
    # largest projection in bf16: up/gate/down, 4096 x 11008).
    shards = lambda prof: sum(w.chunks * w.slice_bytes for layer in prof.layers for w in layer.weights)  # noqa: E731
    assert p.static_bytes - plain.static_bytes == shards(p) - shards(plain) + 2 * 4096 * 11008


@pytest.mark.parametrize("weights_on, kwargs", [
    (None, {}),
    (None, {"prefetch_depth": None}),
    ("device", {"prefetch_depth": None}),
])
def test_plans_keep_the_profiles_format(weights_on, kwargs):
    """The search has no format dimension: every plan of a quantized profile has its format
    (recorded in the plan's JSON); a profile of another format refuses the plan."""
    tier = {} if weights_on is None else {"host_tier": True, "weights_on": weights_on}
    for fmt in ("nf4", "int8"):
        p = synthetic_profile("llama2-7b", 8, 2048, "a100-40g-pcie", weight_format=fmt, **tier)
        plan = plan_from_profile(p, 40 * 10**9, 32, **kwargs)
        assert plan.weight_format == p.weight_format
        assert json.loads(plan.to_json())["weight_format"]["name"] == fmt
        assert Plan.from_json(plan.to_json()) == plan
        plan.check_profile(p)
        with pytest.raises(ProfileError, match=f"plan is for weights stored {fmt}"):
            plan.check_profile(synthetic_profile("llama2-7b", 8, 2048, "a100-40g-pcie", **tier))
    plain = plan_from_profile(synthetic_profile("llama2-7b", 8, 2048, "a100-40g-pcie", **tier), 40 * 10**9, 32,
                              **kwargs)
    assert plain.weight_format is None and json.loads(plain.to_json())["weight_format"] is None


@pytest.mark.parametrize("fmt", [("nf4", 64, False), ("nf4", 64, True), ("int8", 64, False), ("int8", 256, False)])
@pytest.mark.parametrize("rows,cols,elem,chunk_bytes,dp", [(100, 256, 4, 8 * 256 * 4, 2), (96, 512, 2, 4096, 4),
                                                          (7, 256, 4, 1 << 20, 3),
                                                          # issue 28: rows no block divides (688 = 16 x 43;
                                                          # 101 odd: 64 rows per chunk for block 64)
                                                          (70, 688, 2, 688 * 2 * 6, 2), (150, 101, 4, 4096, 3)])
def test_pipeline_weight_bytes_are_the_runtimes_quantized_layout(fmt, rows, cols, elem, chunk_bytes, dp):
    """The pipeline planner's weight (planner/pipeline_profile.py PipeWeight) sizes a quantized
    weight as the runtime stores it: rows per chunk from the weight's own rows (rounded to whole
    blocks, ElasticPolicy.weight_rows_per_chunk), each chunk a blob, the image sharded by
    QuantizedLayout.image_layout (ragged last chunk included)."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.planner.pipeline_model import PipeWeight
    from elastic_kernels.api.planner.profile import WeightFormat
    from elastic_kernels.quant import QuantizedLayout

    name, block, nested = fmt
    policy = ElasticPolicy(chunk_bytes=chunk_bytes, weight_format=name, quant_block_size=block, quant_nested=nested)
    rpc = min(rows, policy.weight_rows_per_chunk("w", (rows, cols), cols * elem))
    q = QuantizedLayout(rows, cols, rpc, name, block, nested)
    image = q.image_layout(dp)
    got = PipeWeight("w", rows, cols, elem, True, WeightFormat(name, block, nested)).layout(chunk_bytes, dp)
    assert got == (image.num_chunks, q.full_blob_bytes, image.slice_numel, q.total_bytes)
    plain = PipeWeight("w", rows, cols, elem).layout(chunk_bytes, dp)
    assert got[3] < plain[3]  # fewer bytes
    if cols % block == 0:
        assert plain[0] == got[0]  # the same chunks when the block divides the row


@pytest.mark.parametrize("fmt", [("nf4", 64, False), ("nf4", 64, True), ("int8", 256, False)])
def test_synthetic_weight_of_any_row_length_is_the_runtimes_layout(fmt):
    """planner/shapes.py's weight (issue 28): a row no block divides is chunked as the runtime
    chunks it (rows_per_chunk rounded to whole blocks) and each chunk is its blob, the last one
    ending in a partial block."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.planner.profile import Link
    from elastic_kernels.api.planner.shapes import _weight
    from elastic_kernels.quant import QuantizedLayout

    name, block, nested = fmt
    rows, cols, ranks, chunk_bytes = 66, 688, 4, 688 * 2 * 6  # 6 bf16 rows fit
    w = _weight("down", rows, cols, ranks, chunk_bytes, fmt=WeightFormat(name, block, nested),
                dequant=Link(5e-6, 1e12))
    rpc = ElasticPolicy(chunk_bytes=chunk_bytes, weight_format=name, quant_block_size=block,
                        quant_nested=nested).weight_rows_per_chunk("down", (rows, cols), cols * 2)
    assert rpc == (4 if name == "nf4" else 16)
    q = QuantizedLayout(rows, cols, rpc, name, block, nested)
    assert (w.chunks, w.chunk_bytes, w.slice_bytes, w.last_bytes) == (
        q.num_chunks, q.full_blob_bytes, -(-q.full_blob_bytes // ranks), q.blob_bytes[-1])
