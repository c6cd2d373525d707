"""Quantized frozen weights under the runtime (python_api/quant, [Note: quantized frozen
weights]): parity on 1 and 2 gloo ranks against a single-process model computing with the
dequantized values, the shard each rank builds, the bytes the all-gathers move and the chunks
a pool budget holds.

The reference of the parity tests is the same model, its weights replaced by their
dequantized values (tests/quant/_models.py: the kernels layer's quantizer and dequantizer,
checked bit for bit against bitsandbytes and the int8 reference in tests/kernels), converted
without a format under the same chunking at world size 1: same values, same chunked op order,
so losses and adapter gradients must be equal bit for bit in fp32."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.quant._models import HIDDEN, TARGETS, dequantize_model_, quant_llama

FORMATS = [("nf4", None, False), ("nf4", None, True), ("int8", 64, False)]
CHUNK = HIDDEN * 4 * 7  # 7 fp32 rows of a 64-wide weight; 3 rows of the 128-wide down_proj


def _policy(fmt=None, block=None, nested=False, **kw):
    from elastic_kernels.api import ElasticPolicy

    kw.setdefault("chunk_bytes", CHUNK)
    return ElasticPolicy(weight_format=fmt, quant_block_size=block, quant_nested=nested, **kw)


def _train(model, policy_kwargs, fmt, block, nested, steps=2):
    """Convert `model`, give the adapters fixed non-zero values, run `steps` SGD steps on one
    fixed batch; returns the losses, the adapter gradients of every step and the runtime stats."""
    return _train_converted(model, _policy(fmt, block, nested, **policy_kwargs), TARGETS, steps)


def _train_converted(model, policy, targets, steps):
    """`_train` for any policy and LoRA targets."""
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers, reset_stats, stats

    elastic = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=targets), policy)
    gen = torch.Generator().manual_seed(7)
    for _, layer in lora_layers(elastic):
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    losses, grads, per_step = [], [], []
    for _ in range(steps):
        reset_stats(elastic)
        out = elastic(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach().clone())
        step = {}
        with torch.no_grad():
            for name, layer in lora_layers(elastic):
                for p, which in ((layer.lora_A.weight, "A"), (layer.lora_B.weight, "B")):
                    step[f"{name}.{which}"] = p.grad.clone()
                    p -= 0.5 * p.grad
                    p.grad = None
        grads.append(step)
        per_step.append(stats(elastic) | {"per_weight": elastic._elastic_runtime.stats(per_weight=True)
                                          ["allgather_bytes_per_weight"]})
    return losses, grads, per_step, elastic


def _reference(policy_kwargs, fmt, block, nested):
    """The single-process model on the dequantized weights, same chunking, no format."""
    from elastic_kernels.api import ElasticPolicy

    model = quant_llama()
    pol = ElasticPolicy(chunk_bytes=policy_kwargs.get("chunk_bytes", CHUNK))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    if policy_kwargs.get("replicate_below_bytes", 1 << 20) == 0:
        names.append("lm_head")
    else:
        names = [n for n in names if n.rpartition(".")[2] in TARGETS]
    dequantize_model_(model, names, lambda w: pol.rows_per_chunk(w.shape[1] * 4), fmt, block, nested)
    kw = {k: v for k, v in policy_kwargs.items() if k == "replicate_below_bytes"}
    # The ranks run with one intra-op thread (tests/_dist.py); a CPU GEMM's reduction order
    # depends on the thread count, so the reference must use one too to compare bit for bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, kw, None, None, False)
    finally:
        torch.set_num_threads(threads)


def _worker(rank, world_size, policy_kwargs, fmt, block, nested):
    losses, grads, per_step, elastic = _train(quant_llama(), policy_kwargs, fmt, block, nested)
    rt = elastic._elastic_runtime
    shards = {et.name: (et.shard.dtype, et.shard.numel()) for et in rt.tensors}
    return losses, grads, per_step, shards


PARITY = [
    (1, {}),
    (2, dict(keep_ratio=0.5, persist_ratio=0.0, pool_budget_bytes=0)),
    # every linear quantized, lm_head included (quant_skip_modules=(): not the default)
    (2, dict(keep_ratio=1.0, persist_ratio=0.5, replicate_below_bytes=0, quant_skip_modules=())),
]


@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-64"])
@pytest.mark.parametrize("world_size,policy", PARITY, ids=["w1", "w2-budget0", "w2-all-linears"])
def test_parity_with_dequantized_model(world_size, policy, fmt, block, nested):
    ref_losses, ref_grads, _, _ = _reference(policy, fmt, block, nested)
    results = run_distributed(_worker, world_size, policy, fmt, block, nested, timeout=300)
    for rank, (losses, grads, _, shards) in enumerate(results):
        for s, (ours, theirs) in enumerate(zip(losses, ref_losses)):
            assert torch.equal(ours, theirs), f"rank {rank} step {s}: loss {ours.item()!r} != {theirs.item()!r}"
        for s, (ours, theirs) in enumerate(zip(grads, ref_grads)):
            assert ours.keys() == theirs.keys()
            for k in ours:
                assert torch.equal(ours[k], theirs[k]), (
                    f"rank {rank} step {s}: grad of {k} differs, max |diff| {(ours[k] - theirs[k]).abs().max().item()}")
        for name, (dtype, _) in shards.items():
            assert dtype == torch.uint8, f"{name}: the shard holds {dtype}, not the quantized image"
    # The quantized model is a different model: it must not equal the full-precision one.
    fp_losses, _, _, _ = _train(quant_llama(), {k: v for k, v in policy.items() if k == "replicate_below_bytes"},
                                None, None, False)
    assert not torch.equal(fp_losses[0], ref_losses[0])


def _blob_bytes(fmt, block, nested, rows, cols):
    """The analytic size of one chunk's blob, from the format's definition (blob.py)."""
    n = rows * cols
    block = block or (64 if fmt == "nf4" else 256)
    nb = n // block
    if fmt == "int8":
        return n + 4 * nb
    if nested:
        return n // 2 + nb + 4 * -(-nb // 256) + 4
    return n // 2 + 4 * nb


def _gathers_worker(rank, world_size, policy_kwargs, fmt, block, nested):
    """The quantized model's and the unquantized model's per-step stats, one after the other
    in the same process group (the same sequence of collectives on every rank)."""
    _, _, per_step, elastic = _train(quant_llama(), policy_kwargs, fmt, block, nested)
    rt = elastic._elastic_runtime
    layout = {et.name: (et.layout.rows, et.layout.cols, et.layout.rows_per_chunk, et.num_chunks) for et in rt.tensors}
    _, _, fp_steps, _ = _train(quant_llama(), policy_kwargs, None, None, False)
    return per_step, layout, fp_steps


BUDGETS = [
    ("budget0", dict(keep_ratio=0.0, persist_ratio=0.0, pool_budget_bytes=0)),
    ("partial", dict(keep_ratio=1.0, persist_ratio=0.5)),
    ("all", dict(keep_ratio=1.0, persist_ratio=1.0)),
]


@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-64"])
@pytest.mark.parametrize("label,policy", BUDGETS, ids=[b[0] for b in BUDGETS])
def test_gathered_bytes_are_the_quantized_size(label, policy, fmt, block, nested):
    """Per weight and per step: bytes received = chunk gathers x (W - 1) x the slice of the
    analytic blob size, and the chunk gathers are those of the same run unquantized (the
    chunking and residency do not change with the format); at budget "all" the first step
    gathers every chunk once, the second nothing."""
    world = 2
    policy = dict(policy, replicate_below_bytes=0, quant_skip_modules=())  # lm_head gathered quantized too
    q = run_distributed(_gathers_worker, world, policy, fmt, block, nested, timeout=300)
    q_steps, layout, fp_steps = q[0]
    assert q[1][0] == q_steps  # symmetric ranks
    for step, (qs, fs) in enumerate(zip(q_steps, fp_steps)):
        total = 0
        for name, (rows, cols, rpc, nc) in layout.items():
            q_slice = -(-_blob_bytes(fmt, block, nested, rpc, cols) // world)
            fp_slice = -(-(rpc * cols * 4) // world)
            assert fs["per_weight"][name] % ((world - 1) * fp_slice) == 0
            gathers = fs["per_weight"][name] // ((world - 1) * fp_slice)
            assert qs["per_weight"][name] == gathers * (world - 1) * q_slice, (step, name)
            if label == "all":
                assert gathers == (nc if step == 0 else 0), (step, name, gathers)
            if label == "budget0":
                assert gathers >= nc, (step, name, gathers)  # at least the forward's
            total += qs["per_weight"][name]
        assert qs["allgather_bytes"] == total, step
        assert qs["allgather_bytes"] < fs["allgather_bytes"] / 3 or (label == "all" and step == 1)


def _pool_worker(rank, world_size, budget, fmt, block, nested):
    out = []
    for f, b, n in ((fmt, block, nested), (None, None, False)):  # quantized, then unquantized
        # Unquantized, in pages too: a partial budget would hold whole fp32 weights as runs
        # ([Note: resident runs]); quantized weights are never runs.
        _, _, _, elastic = _train(quant_llama(), dict(keep_ratio=1.0, persist_ratio=1.0, pool_budget_bytes=budget,
                                                      replicate_below_bytes=0, prefetch_depth=0,
                                                      quant_skip_modules=(), resident_runs=f is not None),
                                  f, b, n)
        rt = elastic._elastic_runtime
        resident = sum(1 for et in rt.tensors for k in et.keys if rt.pool.contains(k))
        blobs = {et.name: (et.layout.rows_per_chunk, et.layout.cols, et.num_chunks) for et in rt.tensors}
        units = {}
        for et in rt.tensors:
            units[et.unit] = units.get(et.unit, 0) + et.num_chunks
        out.append((resident, rt.page_bytes(), blobs, max(units.values())))
    return out


@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-64"])
def test_pool_holds_the_predicted_chunks(fmt, block, nested):
    """At a fixed budget the pool caches (budget + working set) // page chunks, a page being
    the largest quantized chunk rounded up to 512 bytes, and more chunks than the same budget
    holds unquantized (fp32 pages here)."""
    budget = 24 * 1024
    ((q_res, q_page, blobs, ws_chunks), (fp_res, fp_page, _, _)), _ = run_distributed(
        _pool_worker, 2, budget, fmt, block, nested, timeout=300)
    largest = max(_blob_bytes(fmt, block, nested, rpc, cols) for rpc, cols, _ in blobs.values())
    assert q_page == -(-largest // 512) * 512
    total = sum(nc for _, _, nc in blobs.values())
    predicted = min(total, (budget + ws_chunks * q_page) // q_page)
    assert q_res == predicted, (q_res, predicted, total)
    fp_predicted = min(total, (budget + ws_chunks * fp_page) // fp_page)
    assert fp_res == fp_predicted
    assert q_res > fp_res


# --------------------------------------------- any row length (issue 28: blocks over the flattened weight)

# Rows of 688 (down_proj [66, 688]: 43 blocks of 64 per 4 rows) and of 66 (q/k/v/o [66, 66]:
# 33 blocks per 32 rows): no block divides a row. 6 rows of 688 fit a chunk; the runtime rounds
# to whole blocks (nf4 64: 4 rows, int8 256: 16 rows; 32 rows of 66 for nf4), and every last
# chunk ends in a partial block (66 rows: 2 rows left).
ODD_CHUNK = 688 * 4 * 6
ODD_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def odd_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=66, intermediate_size=688, num_hidden_layers=1,
                      num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def _odd_train(model, policy, steps=2):
    losses, grads, _, elastic = _train_converted(model, policy, ODD_TARGETS, steps)
    return losses, grads, elastic


def _odd_worker(rank, world_size, policy_kwargs, fmt, block, nested):
    from elastic_kernels.api import ElasticPolicy

    policy = ElasticPolicy(chunk_bytes=ODD_CHUNK, weight_format=fmt, quant_block_size=block, quant_nested=nested,
                           **policy_kwargs)
    losses, grads, elastic = _odd_train(odd_llama(), policy)
    rpc = {et.name.rpartition(".")[2]: (et.layout.rows_per_chunk, et.qlayout.rows_per_chunk, et.num_chunks)
           for et in elastic._elastic_runtime.tensors}
    return losses, grads, rpc


@pytest.mark.parametrize("fmt,block,nested", [("nf4", None, False), ("nf4", None, True), ("int8", None, False)],
                         ids=["nf4", "nf4-nested", "int8-256"])
@pytest.mark.parametrize("world_size,policy", [(1, {}), (2, dict(keep_ratio=0.5, persist_ratio=0.0,
                                                                 pool_budget_bytes=0))], ids=["w1", "w2-budget0"])
def test_parity_any_row_length(world_size, policy, fmt, block, nested, monkeypatch):
    """A model whose rows no block divides (issue 28) trains quantized, bit for bit as the same
    model computing with the dequantized values, converted without a format under the same
    chunking (the reference's rows_per_chunk is made the rounded one the quantized run uses)."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.config import quant_rows_per_chunk

    bs = block or (64 if fmt == "nf4" else 256)
    results = run_distributed(_odd_worker, world_size, policy, fmt, block, nested, timeout=300)
    rpc = results[0][2]
    want_down = 4 if fmt == "nf4" else 16  # 64 / gcd(688, 64), 256 / gcd(688, 256): 6 rows fit, rounded
    assert rpc["down_proj"] == (want_down, want_down, -(-66 // want_down)), rpc
    assert rpc["q_proj"][:2] == ((32, 32) if fmt == "nf4" else (66, 66)), rpc  # 256 / gcd(66, 256) = 128 > 66

    # The reference: the dequantized values, no format, the quantized run's chunking.
    model = odd_llama()
    ref_policy = ElasticPolicy(chunk_bytes=ODD_CHUNK)

    def rounded(self, name, shape, row_bytes):
        return quant_rows_per_chunk(self.rows_per_chunk(row_bytes, name), int(shape[0]), int(shape[1]), bs)
    names = [f"model.layers.0.{'self_attn' if t[0] in 'qkvo' else 'mlp'}.{t}" for t in ODD_TARGETS]
    dequantize_model_(model, names, lambda w: quant_rows_per_chunk(ODD_CHUNK // (w.shape[1] * 4), w.shape[0],
                                                                    w.shape[1], bs), fmt, block, nested)
    monkeypatch.setattr(ElasticPolicy, "weight_rows_per_chunk", rounded)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_losses, ref_grads, ref = _odd_train(model, ref_policy)
    finally:
        torch.set_num_threads(threads)
    assert {et.name.rpartition(".")[2]: et.layout.rows_per_chunk for et in ref._elastic_runtime.tensors} == \
        {k: v[0] for k, v in rpc.items()}
    for rank, (losses, grads, _) in enumerate(results):
        for s, (ours, theirs) in enumerate(zip(losses, ref_losses)):
            assert torch.equal(ours, theirs), f"rank {rank} step {s}: loss {ours.item()!r} != {theirs.item()!r}"
        for s, (ours, theirs) in enumerate(zip(grads, ref_grads)):
            for k in ours:
                assert torch.equal(ours[k], theirs[k]), (rank, s, k, (ours[k] - theirs[k]).abs().max().item())
    fp_losses, _, _ = _odd_train(odd_llama(), ElasticPolicy(chunk_bytes=ODD_CHUNK))
    assert not torch.equal(fp_losses[0], ref_losses[0])  # the quantized model is another model
