"""Quantized frozen weights in the host tier ([Note: filling the host store] in
python_api/host/sources.py): the node's host store holds each weight's quantized image, a host
copy moves a chunk's blob into its page, and the use dequantizes it as it does a gathered one.

One process group of 2 gloo ranks (one node: both ranks fill the one store, each its share)
runs every case, for nf4, nested nf4 and int8 (block 64), with every linear under the runtime:
- parity: losses and adapter gradients bit for bit equal, in fp32, to the single-process model
  on the dequantized weights (tests/quant/test_runtime_quant.py's reference: the kernels
  layer's quantizer and dequantizer, checked against bitsandbytes and the int8 reference),
  with weights_on="host" and with a host_fraction split (peer and host chunks in one use);
- the store: its bytes are each weight's image as `QuantizedLayout.quantize` makes it from the
  whole weight (so the ranks' shares of the fill tile it exactly), and its size is the sum of
  the analytic blob sizes, each weight's image padded to 512 bytes;
- traffic: H2D bytes per step equal the analytic blob sizes of the host chunks missed, and
  all-gathered bytes those of the peer chunks, at pool budgets 0, partial and all;
- load_elastic fills the store from the files' rows; load_state_dict into a host weight
  re-quantizes the new value into the store; the rows with
  NaN or Inf are counted by the rank that quantized them into the store;
- the planner: a plan measured on a weights_on="host" nf4 model predicts its H2D bytes
  exactly (its chunk bytes are the blobs'), with activation offload off and on;
and a 2-step CLI run with --weights-on host --weight-format nf4."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.quant._models import quant_llama
from tests.quant.test_runtime_quant import CHUNK, _blob_bytes, _reference, _train

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

FORMATS = [("nf4", None, False), ("nf4", None, True), ("int8", 64, False)]
ALL = dict(replicate_below_bytes=0, quant_skip_modules=())  # every linear under the runtime and quantized, lm_head too
BUDGETS = {
    "budget0": dict(keep_ratio=0.0, persist_ratio=0.0, pool_budget_bytes=0),
    "partial": dict(keep_ratio=1.0, persist_ratio=0.5),
    "all": dict(keep_ratio=1.0, persist_ratio=1.0),
}
# (label, weights_on, host_fraction, budget): both sources at every budget between them.
SOURCES = [("host-budget0", "host", None, "budget0"), ("split-partial", "device", 0.5, "partial"),
           ("host-all", "host", None, "all"), ("split-budget0", "device", 0.3, "budget0")]
WORLD = 2


def _host_chunk(c: int, f: float) -> bool:
    """[Note: chunk sources], recomputed here: chunk c comes from the host store."""
    return f >= 1.0 or (f > 0 and int((c + 1) * f) > int(c * f))


def _worker(rank, world_size, cases, offload_fmt, path):
    from elastic_kernels.quant import QuantizedLayout

    out = []
    for fmt, block, nested, label, on, hf, budget in cases:
        policy = dict(ALL, weights_on=on, host_fraction=hf, **BUDGETS[budget])
        losses, grads, per_step, elastic = _train(quant_llama(), policy, fmt, block, nested)
        rt = elastic._elastic_runtime
        original = quant_llama()
        stored = {}
        for et in rt.tensors:
            ql = QuantizedLayout(et.layout.rows, et.layout.cols, et.layout.rows_per_chunk, fmt, block, nested)
            w = original.get_submodule(et.name).weight.detach()
            image = rt.host_store.view(et.store_offset, torch.uint8, (ql.total_bytes,))
            stored[et.name] = (et.layout.rows_per_chunk, et.layout.cols, et.num_chunks, torch.equal(image, ql.quantize(w)),
                               None if et.shard is None else et.shard.dtype)
        steps = [(s["h2d_bytes"], s["allgather_bytes"], s["host_store_bytes"]) for s in per_step]
        if label == "host-budget0":
            stored["loaded"] = _load_new_weights(rt, fmt, block, nested)
        out.append((losses, grads, steps, stored))
    # Activation offload beside a quantized host store: the same numerics.
    fmt, block, nested = offload_fmt
    policy = dict(ALL, weights_on="host", offload_activations=True, **BUDGETS["partial"])
    losses, grads, per_step, _ = _train(quant_llama(), policy, fmt, block, nested)
    out.append((losses, grads, [s["d2h_bytes"] for s in per_step], None))
    out.append(_nonfinite(rank))
    out.append(_loaded(path))
    out.append(_planned(rank))
    return out


def _load_new_weights(rt, fmt, block, nested) -> bool:
    """load_state_dict's path into a host weight (`load_full_weight`): the store then holds the
    new weight's image and the runtime returns its dequantized values."""
    from elastic_kernels.api.nn import load_full_weight
    from elastic_kernels.quant import QuantizedLayout
    from tests.quant._models import dequantized

    new = quant_llama(seed=1)
    ok = True
    for et in rt.tensors:
        w = new.get_submodule(et.name).weight.detach()
        load_full_weight(et, w)
        ql = QuantizedLayout(et.layout.rows, et.layout.cols, et.layout.rows_per_chunk, fmt, block, nested)
        ok &= torch.equal(rt.host_store.view(et.store_offset, torch.uint8, (ql.total_bytes,)), ql.quantize(w))
        ok &= torch.equal(rt.full_weight(et), dequantized(w, et.layout.rows_per_chunk, fmt, block, nested))
    return ok


def _loaded(path) -> bool:
    """load_elastic from safetensors with weights_on="host": the ranks fill the store from the
    rows they read of the files, quantized as the in-memory model's weights are."""
    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.nn import LoRAConfig
    from elastic_kernels.quant import QuantizedLayout

    model = load_elastic(path, LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                         ElasticPolicy(chunk_bytes=CHUNK, weight_format="nf4", quant_nested=True, weights_on="host",
                                       replicate_below_bytes=0, quant_skip_modules=()))  # lm_head too
    rt, original = model._elastic_runtime, quant_llama()
    ok = len(rt.tensors) == 2 * 7 + 1
    for et in rt.tensors:
        ql = QuantizedLayout(et.layout.rows, et.layout.cols, et.layout.rows_per_chunk, "nf4", None, True)
        ok &= torch.equal(rt.host_store.view(et.store_offset, torch.uint8, (ql.total_bytes,)),
                          ql.quantize(original.get_submodule(et.name).weight.detach()))
    return ok


def _nonfinite(rank):
    """Non-finite values in the rows each rank quantized into the store (weights_on="host":
    no shard; the engine's load check reads `nonfinite_read`): per weight, over the ranks of a
    node, every value once."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    model = quant_llama()
    with torch.no_grad():
        w = model.get_submodule("model.layers.1.mlp.down_proj").weight
        w[0, 5] = w[0, 7] = float("nan")  # row 0: the first rank's share
        w[-1, 3] = float("inf")  # the last row: the second rank's
    elastic = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                                 ElasticPolicy(chunk_bytes=CHUNK, weight_format="nf4", quant_nested=True,
                                               weights_on="host", replicate_below_bytes=0))
    return {et.name: et.nonfinite_read for et in elastic._elastic_runtime.tensors if et.nonfinite_read}


def _planned(rank):
    """(measured (all-gather, H2D) per step, predicted) for plans on a weights_on="host" nf4
    model measured by the planner's profiler, offload off and on."""
    import dataclasses

    from elastic_kernels.api import ElasticPolicy, reset_stats, stats
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic
    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile

    model = convert_to_elastic(quant_llama(), LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=3),
                               ElasticPolicy(chunk_bytes=CHUNK, weight_format="nf4", weights_on="host"))
    model.train()
    gen = torch.Generator().manual_seed(100 + rank)
    profile = measure_profile(model, [torch.randint(0, 64, (2, 9), generator=gen)], capacity_bytes=1 << 30)
    chunk_bytes = [(w.name, w.chunk_bytes, w.last_bytes) for layer in profile.layers for w in layer.weights]
    out = []
    for offload in (False, True):
        choices = Choices(micro_batch=2, keep=tuple(tuple(w.chunks // 2 for w in layer.weights) for layer in profile.layers),
                          persist=tuple(tuple(0 for _ in layer.weights) for layer in profile.layers),
                          recompute=tuple(False for _ in profile.layers), host_fraction=1.0)
        plan = plan_of(profile, dataclasses.replace(choices, offload=offload), memory_bytes=1 << 30,
                       global_batch=2 * WORLD)
        apply_plan(model, plan)
        measured = []
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 9), generator=gen)
            reset_stats(model)
            model(input_ids=ids, labels=ids).loss.backward()
            s = stats(model)
            measured.append((s["allgather_bytes"], s["h2d_bytes"]))
        out.append((offload, measured, (plan.predicted_allgather_bytes_per_step, plan.predicted_h2d_bytes_per_step)))
    return chunk_bytes, out


def _backward_use(name: str) -> bool:
    """Whether a weight is used again in backward (for its input's gradient): all but the first
    layer's q/k/v, whose input (the frozen embedding through a frozen norm) needs none."""
    return not any(name == f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))


def _analytic(stored, fmt, block, nested, hf, budget, step):
    """(H2D, all-gather) bytes of step `step` (0 or 1) of `_train`, from the layout alone."""
    f = 1.0 if hf is None else hf
    h2d = gathered = 0
    for name, (rpc, cols, nc, _, _) in stored.items():
        full = _blob_bytes(fmt, block, nested, rpc, cols)
        for c in range(nc):
            if budget == "budget0":
                uses = 1 + _backward_use(name)  # nothing is kept: forward and backward copy again
            elif budget == "partial":  # kept to backward; from the second step, the first half persists
                uses = 1 if step == 0 or c >= int(0.5 * nc + 0.5) else 0
            else:
                uses = 1 if step == 0 else 0
            if _host_chunk(c, f):  # the chunk's own blob (a ragged last chunk's is smaller), no padding
                h2d += uses * _blob_bytes(fmt, block, nested, min(rpc, _rows(name) - c * rpc), cols)
            else:  # (W - 1) slices of a full blob (a ragged last chunk is padded to full slices)
                gathered += uses * (WORLD - 1) * -(-full // WORLD)
    return h2d, gathered


_ROWS: dict[str, int] = {}


def _rows(name: str) -> int:
    """Rows of the linear `name` of the test model."""
    if not _ROWS:
        _ROWS.update({n: m.weight.shape[0] for n, m in quant_llama().named_modules() if isinstance(m, torch.nn.Linear)})
    return _ROWS[name]


def test_host_tier_with_quantized_weights(tmp_path):
    # Every source and budget on nf4; weights_on="host" at budget 0 and the split at a partial
    # budget on the other formats (what differs between formats is the blob, not the sources).
    cases = [(fmt, block, nested, label, on, hf, budget)
             for fmt, block, nested in FORMATS for label, on, hf, budget in SOURCES
             if fmt == "nf4" and not nested or label in ("host-budget0", "split-partial")]
    quant_llama().save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="60KB")
    results = run_distributed(_worker, WORLD, cases, FORMATS[0], str(tmp_path), timeout=600)
    refs = {f: _reference(ALL, *f) for f in FORMATS}
    for rank, res in enumerate(results):
        *per_case, offload, nonfinite, loaded, (chunk_bytes, planned) = res
        assert loaded, f"rank {rank}: load_elastic did not fill the store with the weights' images"
        assert nonfinite == {"model.layers.1.mlp.down_proj": 2 if rank == 0 else 1}, (rank, nonfinite)
        for (fmt, block, nested, label, on, hf, budget), (losses, grads, steps, stored) in zip(cases, per_case):
            what = f"rank {rank} {fmt}{'-nested' if nested else ''} {label}"
            ref_losses, ref_grads, _, _ = refs[(fmt, block, nested)]
            for s, (ours, theirs) in enumerate(zip(losses, ref_losses)):
                assert torch.equal(ours, theirs), f"{what} step {s}: loss {ours.item()!r} != {theirs.item()!r}"
            for s, (ours, theirs) in enumerate(zip(grads, ref_grads)):
                for k in theirs:
                    assert torch.equal(ours[k], theirs[k]), f"{what} step {s}: gradient of {k} differs"
            if label == "host-budget0":
                assert stored.pop("loaded"), f"{what}: load_state_dict did not store the new weights' images"
            for name, (_, _, _, equal, shard_dtype) in stored.items():
                assert equal, f"{what}: the host store's bytes of {name} are not its quantized image"
                assert shard_dtype == (None if on == "host" else torch.uint8), (what, name, shard_dtype)
            images = [sum(_blob_bytes(fmt, block, nested, min(rpc, _rows(n) - c * rpc), cols)
                          for c in range(nc)) for n, (rpc, cols, nc, _, _) in stored.items()]
            store = sum(-(-b // 512) * 512 for b in images)
            fp32 = sum(_rows(n) * cols * 4 for n, (_, cols, _, _, _) in stored.items())
            for step, (h2d, gathered, store_bytes) in enumerate(steps):
                assert store_bytes == store and store < fp32 / 3, (what, store_bytes, store, fp32)
                assert (h2d, gathered) == _analytic(stored, fmt, block, nested, hf, budget, step), (what, step)
                assert h2d > 0 or (budget == "all" and step == 1), (what, step)
        losses, grads, d2h, _ = offload
        ref_losses, ref_grads, _, _ = refs[FORMATS[0]]
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), f"rank {rank}: offload changed the losses"
        assert all(torch.equal(g[k], r[k]) for g, r in zip(grads, ref_grads) for k in r)
        assert all(d > 0 for d in d2h), d2h  # activations did go to the host
        for name, full, last in chunk_bytes:  # the profile's chunk bytes are the blobs'
            rows, cols = _rows(name), 128 if name.endswith("down_proj") else 64
            rpc = min(rows, CHUNK // (cols * 4))
            assert full == _blob_bytes("nf4", None, False, rpc, cols), name
            assert last == _blob_bytes("nf4", None, False, rows - (-(-rows // rpc) - 1) * rpc, cols), name
        for offload_on, measured, predicted in planned:
            assert measured[1:] == [predicted] * 2 and predicted[1] > 0, (offload_on, measured, predicted)
            assert predicted[0] == 0
    assert all(r[-1][1] == results[0][-1][1] for r in results[1:]), "ranks saw different traffic"


def test_cli_host_weights_nf4(tmp_path):
    """--weights-on host --weight-format nf4 on 2 ranks, 2 steps, the whole pool: the first step
    copies every chunk into each rank's pool once, i.e. exactly the quantized weights' bytes
    (frozen_bytes, as stored), the second nothing; --compare-host with a format is accepted."""
    from elastic_kernels.api.finetune.options import parse_args
    from elastic_kernels.api.finetune.policy import policy_of
    from tests.finetune.test_finetune import summary_of, torchrun
    from tests.quant.test_cli import BASE

    args = parse_args(BASE + ["--weight-format", "int8", "--quant-block", "64", "--compare-host"])
    p = policy_of(args, None, weights_on="host")
    assert (p.weight_format, p.block_size, p.weights_on) == ("int8", 64, "host")
    d = str(tmp_path / "nf4")
    torchrun(BASE + ["--steps", "2", "--weight-format", "nf4", "--weights-on", "host", "--save-dir", d],
             what="--weights-on host --weight-format nf4")
    (run,) = summary_of(d)["runs"]
    assert run["status"] == "complete", run
    assert run["frozen_bytes"] > 0 and run["h2d_bytes_per_step"] == [run["frozen_bytes"], 0], run
    assert run["allgather_bytes_first_step"] == 0
