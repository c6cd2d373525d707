"""Embeddings under the runtime ([Note: embeddings under the runtime] in
python_api/nn/embedding.py): `ElasticEmbedding` and a tied output layer sharing its elastic
tensor, against PEFT on a tiny Llama with tie_word_embeddings both ways and a tiny GPT-2
(Conv1D layers, wte tied to lm_head, wpe a second embedding); exact all-gather bytes with the
tables gathered; static memory without the replicated table; state dicts, save_pretrained and
merge_adapters on a tied model.

fp32 tolerances as in tests/nn/test_lora.py (rtol = atol = 1e-4: chunked GEMMs differ from
PEFT's whole ones only in summation order, ~1e-5 relative at these sizes, while a wrong row,
chunk or tie changes results at the 1e-2 level). A lookup is a copy of rows, compared bit for
bit with the plain table.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.nn as nn

from tests._dist import run_distributed
from tests.nn.test_lora import _copy_adapters_into_peft

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TOL = dict(rtol=1e-4, atol=1e-4)
FP32 = 4
CHUNK = 32 * FP32 * 5  # 5 rows of a 32-wide table per chunk: 13 chunks of 64 rows, the last ragged
BLOCK = 5 * CHUNK  # row blocks of 25 rows (5 chunks): a 64-row table in blocks of 25, 25 and 14 rows
BUDGET0 = dict(chunk_bytes=CHUNK, keep_ratio=0.0, persist_ratio=0.0, pool_budget_bytes=0, replicate_below_bytes=0,
               shard_embeddings=True, table_block_bytes=BLOCK)
ALL = dict(chunk_bytes=CHUNK, replicate_below_bytes=0, shard_embeddings=True,
           table_block_bytes=BLOCK)  # every weight a resident run at 2 ranks
# A budget that holds one 25-row block whole (3,200 bytes) and no other weight beside it: the
# table's blocks are partly runs, partly pages ([Note: resident runs], "Partial budgets").
PARTIAL = dict(ALL, pool_budget_bytes=25 * 32 * FP32 + 100)


def tiny(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg).float().eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=kind == "llama_tied")
    return LlamaForCausalLM(cfg).float().eval()


TARGETS = {"gpt2": ("c_attn",), "llama_tied": ("q_proj", "v_proj"), "llama_untied": ("q_proj", "v_proj")}
TABLES = {"gpt2": ["transformer.wte", "transformer.wpe"], "llama_tied": ["model.embed_tokens"],
          "llama_untied": ["model.embed_tokens"]}
HEAD_TIED = {"gpt2": "transformer.wte", "llama_tied": "model.embed_tokens", "llama_untied": None}


def _layout_bytes(rows: int, cols: int, world_size: int) -> tuple[int, int]:
    """(chunks, slice bytes) of a [rows, cols] fp32 weight at CHUNK bytes per chunk, by the
    layout's arithmetic ([Note: chunk-major shard layout]): whole rows per chunk, each chunk
    split into W equal slices (the ragged last chunk padded)."""
    rpc = min(rows, max(1, CHUNK // (cols * FP32)))
    return -(-rows // rpc), -(-rpc * cols // world_size) * FP32


def _own_bytes(rows: int, cols: int, world_size: int, rank: int) -> int:
    """Bytes of rank `rank`'s shard of a [rows, cols] fp32 weight as the runtime holds it ([Note:
    chunk-major shard layout]): the full slices of every chunk but the last, then its real
    elements of the ragged last chunk (S of them, fewer or none: no padding)."""
    chunks, slice_bytes = _layout_bytes(rows, cols, world_size)
    s = slice_bytes // FP32
    rpc = min(rows, max(1, CHUNK // (cols * FP32)))
    last = (rows - (chunks - 1) * rpc) * cols
    return ((chunks - 1) * s + min(s, max(0, last - rank * s))) * FP32


def _peft(model, kind):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS[kind]),
                                                           lora_dropout=0.0))


def _parity_worker(rank, world_size, kind, policy):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import (
        ElasticBlocksLinear,
        ElasticEmbedding,
        LoRAConfig,
        convert_to_elastic,
        lora_layers,
        runtime_of,
    )
    from elastic_kernels.api.nn.embedding import elastic_tensors_of

    model = tiny(kind)
    tables = {n: model.get_submodule(n).weight.detach().clone() for n in TABLES[kind]}
    peft_model = _peft(model, kind)
    elastic = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS[kind]), ElasticPolicy(**policy))
    rt = runtime_of(elastic)

    # Structure: every table elastic, the tied head on the same tensor, no replicated table left.
    for n in TABLES[kind]:
        assert isinstance(elastic.get_submodule(n), ElasticEmbedding), (n, type(elastic.get_submodule(n)))
    head = elastic.get_output_embeddings()
    assert isinstance(head, ElasticBlocksLinear), type(head)
    assert [et.shape[0] for et in head.ets] == [25, 25, 14]  # row blocks of BLOCK bytes
    if HEAD_TIED[kind] is not None:
        assert head.ets is elastic.get_submodule(HEAD_TIED[kind]).ets, "the tied head has tensors of its own"
        assert len(rt.tensors) == len({id(et) for et in rt.tensors})
    else:
        assert not set(map(id, head.ets)) & set(map(id, elastic.get_input_embeddings().ets))
    big = {tuple(t.shape) for t in tables.values()}
    assert not [n for n, p in elastic.named_parameters() if tuple(p.shape) in big], "a table is still replicated"

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    # Which elastic layer's input needs a gradient (its weight is gathered again in backward).
    needs_dx, looked_up, hooks = {}, {}, []
    for n, m in elastic.named_modules():
        if isinstance(m, ElasticEmbedding):  # the ids each table is asked for (the same on every rank here)
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, n=n: looked_up.__setitem__(n, args[0].reshape(-1).clone())))
        elif elastic_tensors_of(m):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, n=n: needs_dx.__setitem__(n, bool(args[0].requires_grad))))

    _copy_adapters_into_peft(elastic, peft_model)
    per_step = []
    for it in range(3):
        rt.reset_stats()
        out = elastic(input_ids=ids, labels=ids)
        ref = peft_model(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        torch.testing.assert_close(out.loss, ref.loss, **TOL)
        out.loss.backward()
        ref.loss.backward()
        per_step.append(rt.stats(per_weight=True)["allgather_bytes_per_weight"])
        for name, layer in lora_layers(elastic):
            pm = peft_model.base_model.model.get_submodule(name)
            for ours, theirs in ((layer.lora_A.weight, pm.lora_A["default"].weight),
                                 (layer.lora_B.weight, pm.lora_B["default"].weight)):
                torch.testing.assert_close(ours.grad, theirs.grad, **TOL, msg=lambda m: f"{name}: {m}")
                with torch.no_grad():  # one SGD step on both
                    ours -= 0.5 * ours.grad
                    theirs -= 0.5 * theirs.grad
                ours.grad = theirs.grad = None
    for h in hooks:
        h.remove()
    # A lookup is the plain table's rows, bit for bit (a chunked one at budget 0, a run at
    # budget all). After the steps: lookups alone before the first step would be learned as
    # part of its forward pass (the order then changes once and is learned again).
    for n, table in tables.items():
        look = ids % table.shape[0]
        assert torch.equal(elastic.get_submodule(n)(look), table[look]), n

    # Exact bytes per step, by the layout's arithmetic: at budget 0 every use gathers the
    # (W-1) peer slices of every chunk: a linear (and each row block of a head) in forward
    # and, when its input needs a gradient, in backward; a lookup receives from each peer the
    # rows any rank reads, once each, in full (W-1 copies of cols * 4 bytes per distinct id).
    expected = {}
    if world_size > 1 and policy.get("pool_budget_bytes") == 0:
        uses = {}
        for n, dx in needs_dx.items():
            for et in elastic_tensors_of(elastic.get_submodule(n)):
                uses[et.name] = uses.get(et.name, 0) + 1 + int(dx)
        for et in rt.tensors:
            chunks, slice_bytes = _layout_bytes(*et.shape, world_size)
            expected[et.name] = uses.get(et.name, 0) * chunks * (world_size - 1) * slice_bytes
        for n, ids_read in looked_up.items():
            distinct = torch.unique(ids_read)
            r0 = 0
            for et in elastic.get_submodule(n).ets:
                rows = int(((distinct >= r0) & (distinct < r0 + et.shape[0])).sum())
                expected[et.name] += (world_size - 1) * rows * et.shape[1] * FP32
                r0 += et.shape[0]
        if HEAD_TIED[kind] is not None:
            assert {uses[et.name] for et in head.ets} == {2}, uses  # head forward and backward, not the lookup
        for step in per_step[1:]:  # the first step learns the order; every later one is exact
            assert step == expected, (step, expected)
    elif world_size > 1 and policy == PARTIAL:  # one block of the table whole, the rest in pages
        runs = [et.run is not None for et in rt.tensors]
        blocks = [et.run is not None for et in elastic.get_input_embeddings().ets]
        assert sum(runs) == 1 and sum(blocks) == 1, (runs, blocks)
    elif world_size > 1:  # budget all: the runs are filled once, then nothing moves
        assert all(et.run is not None and et.run.filled for et in rt.tensors)
        # The runs are made at the runtime's first use, after the first lookup (which exchanged
        # its rows); a table no head uses (GPT-2's wpe) fills its runs at its second lookup.
        assert all(v == 0 for step in per_step[2:] for v in step.values()), per_step
    return sorted(expected.items())


@pytest.mark.parametrize("kind,world_size,policy", [
    ("llama_tied", 1, BUDGET0), ("llama_tied", 2, BUDGET0), ("llama_tied", 2, ALL), ("llama_tied", 2, PARTIAL),
    ("llama_untied", 1, ALL), ("llama_untied", 2, BUDGET0),
    ("gpt2", 1, BUDGET0), ("gpt2", 2, BUDGET0), ("gpt2", 2, ALL),
], ids=lambda v: v if isinstance(v, (str, int)) else {id(BUDGET0): "budget0", id(ALL): "all"}.get(id(v), "partial"))
def test_matches_peft(kind, world_size, policy):
    results = run_distributed(_parity_worker, world_size, kind, policy, timeout=300)
    assert all(r == results[0] for r in results), results
    if world_size > 1 and policy is BUDGET0:
        assert dict(results[0]), "no bytes were checked"


def test_tied_bytes_by_hand():
    """The tied Llama's table at budget 0 on 2 ranks, by hand: 64 rows of 32 fp32 in row blocks
    of 25, 25 and 14 rows (BLOCK = 5 chunks of 5 rows), 5 + 5 + 3 chunks (the last one 4 rows,
    padded), each received as the peer's slice of 5 * 32 / 2 = 80 elements (320 bytes): 4,160
    bytes per use of the head, forward and backward (8,320), 1,920 of them for rows 50-64; the
    lookup receives each distinct id's row (128 bytes) once from the peer, not the table."""
    got = dict(run_distributed(_parity_worker, 2, "llama_tied", BUDGET0, timeout=300)[0])
    distinct = torch.unique(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))).numel()
    assert sum(v for k, v in got.items() if k.startswith("model.embed_tokens.rows")) == 8_320 + 128 * distinct, got
    assert got["model.embed_tokens.rows50-64"] == 1_920 + 128 * int((torch.unique(torch.randint(
        0, 64, (2, 9), generator=torch.Generator().manual_seed(3))) >= 50).sum()), got


def test_table_blocks():
    """Row blocks by hand: whole chunks, at most the limit (at least one chunk); a ragged last
    chunk alone joins the block before it."""
    from elastic_kernels.api.nn.embedding import table_blocks

    assert table_blocks(64, 128, 5, BLOCK) == [(0, 25), (25, 50), (50, 64)]
    assert table_blocks(64, 128, 5, 1) == [(r, r + 5) for r in range(0, 55, 5)] + [(55, 64)]  # 4 rows join
    assert table_blocks(64, 128, 5, 10**9) == [(0, 64)]
    # SmolLM2-135M's table (49152 x 576 fp32) at 4 MiB chunks (1820 rows) under a decoder layer's
    # 14,155,776 bytes: 3 chunks (5460 rows) a block; the last 12 rows join the ninth block.
    blocks = table_blocks(49152, 2304, 1820, 14_155_776)
    assert len(blocks) == 9 and blocks[-1] == (43680, 49152) and all(e - b == 5460 for b, e in blocks[:-1])
    with pytest.raises(ValueError, match="must be positive"):
        table_blocks(64, 128, 5, 0)


# ------------------------------------------------------------------ the lookup: rows, not the table

def _lookup_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, runtime_of

    model = tiny("llama_tied")
    with torch.no_grad():  # negative zeros and odd payloads: a copy keeps every bit, a sum would not
        w = model.get_input_embeddings().weight
        w[::3] = -0.0
        w[1, :7] = torch.tensor([1e-45, -1e-45, float("inf"), -float("inf"), 3.0, -0.0, 0.0])
    table = model.get_input_embeddings().weight.detach().clone()
    model = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)), ElasticPolicy(**BUDGET0))
    rt, emb = runtime_of(model), model.get_input_embeddings()
    out = []
    # Different lengths per rank, overlapping ids, one rank with none.
    for ids_of in ({0: [3, 1, 63, 3, 17], 1: [1, 40, 41, 42, 63, 0, 0, 59]}, {0: [7, 7, 7], 1: []}):
        ids = torch.tensor(ids_of[rank], dtype=torch.int64)
        rt.reset_stats()
        got = emb(ids)
        assert torch.equal(got.view(torch.int32), table[ids].view(torch.int32)), "not the table's bits"
        st = rt.stats(per_weight=True)
        out.append((st["allgather_bytes"], st["allgather_calls"],
                    {k: v for k, v in st["allgather_bytes_per_weight"].items() if v}))
    return out


def test_lookup_exchanges_only_the_rows_read():
    """A lookup at budget 0 on 2 ranks: the ids' counts (8 bytes from the peer), the ids padded
    to the longest (8 bytes each), then the rows any rank reads, once each (128 bytes per
    distinct id from the peer), bit for bit, negative zeros included. Case 1: {0,1,3,17,40,41,42,
    59,63} = 9 distinct ids, 8 at most per rank: 8 + 64 + 1,152 = 1,224 bytes in 3 collectives;
    rows 0-25: 4 ids, 25-50: 3, 50-64: 2. Case 2: one id, 3 at most: 8 + 24 + 128."""
    results = run_distributed(_lookup_worker, 2, timeout=180)
    assert results[0] == results[1]
    first, second = results[0]
    assert first == (1_224, 3, {"model.embed_tokens.rows0-25": 512, "model.embed_tokens.rows25-50": 384,
                                "model.embed_tokens.rows50-64": 256}), first
    assert second == (160, 3, {"model.embed_tokens.rows0-25": 128}), second


# ------------------------------------------------------------- the head: one block in flight at a time

def _head_worker(rank, world_size):
    from contextlib import contextmanager

    import torch.nn.functional as F

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, runtime_of

    model = tiny("llama_tied")
    table = model.get_input_embeddings().weight.detach().clone()
    model = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
                               ElasticPolicy(**BUDGET0))
    rt, head = runtime_of(model), model.get_output_embeddings()
    blocks = set(map(id, head.ets))
    in_flight, use = [], rt.use

    @contextmanager
    def counted(et, phase, needs_backward=False):  # table pages in the pool once a block's use started
        with use(et, phase, needs_backward) as resident:
            if id(et) in blocks:
                in_flight.append(sum(rt.pool.contains(k) for b in head.ets for k in b.keys))
            yield resident

    rt.use = counted
    seen = {}
    head.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))

    def keep_output(m, args, y):
        seen["y"] = y
        y.register_hook(lambda g: seen.__setitem__("dy", g))

    head.register_forward_hook(keep_output)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        in_flight.clear()
        out = model(input_ids=ids, labels=ids)
        seen["x"].register_hook(lambda g: seen.__setitem__("dx", g))
        out.loss.backward()
    # The same chunking as the unblocked elastic head, chunk by chunk in row order (5-row
    # chunks): the logits and dx are those bits ([Note: chunked compute and bit-exactness]).
    x2 = seen["x"].detach().reshape(-1, 32)
    ref_y = torch.cat([F.linear(x2, table[r : r + 5]) for r in range(0, 64, 5)], dim=1)
    dy = seen["dy"].reshape(-1, 64)
    ref_dx = torch.zeros_like(x2)
    for r in range(0, 64, 5):
        ref_dx.addmm_(dy[:, r : r + 5], table[r : r + 5])
    exact = (torch.equal(seen["y"].detach().reshape(-1, 64), ref_y), torch.equal(seen["dx"].reshape(-1, 32), ref_dx))
    return in_flight, exact, rt.policy.prefetch_depth


def test_head_has_one_block_in_flight_per_use():
    """Budget 0 on 2 ranks, the tied head in 3 row blocks of 5, 5 and 3 chunks (13 in all): once
    a block's use has started, the pool holds at most that block's and the prefetched next
    block's chunks, (1 + prefetch_depth) * 5 = 10 of the table's 13, forward and backward (the
    unblocked head gathered all 13 for each use); 3 blocks used forward and 3 backward each
    step; logits and dx bit for bit those of the same chunking."""
    for in_flight, exact, depth in run_distributed(_head_worker, 2, timeout=240):
        assert exact == (True, True), exact
        assert len(in_flight) == 6, in_flight
        assert 0 < max(in_flight) <= (1 + depth) * 5 < 13, in_flight


# ------------------------------------------------------------------------------ static memory

def _static_worker(rank, world_size, shard_embeddings):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, runtime_of
    from elastic_kernels.api.planning.peaks import live_tensor_bytes

    base = live_tensor_bytes()
    model = convert_to_elastic(tiny("llama_tied"), LoRAConfig(r=4, alpha=8, target_modules=TARGETS["llama_tied"]),
                               ElasticPolicy(**{**BUDGET0, "shard_embeddings": shard_embeddings}))
    rt = runtime_of(model)
    replicated = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in list(model.parameters()) + list(model.buffers())}
    shards = sum(_own_bytes(*et.shape, world_size, rank) for et in rt.tensors)
    analytic = sum(replicated.values()) + shards
    static = [live_tensor_bytes() - base]
    for _ in range(3):  # a buffer released late (see tests/runtime/test_runs.py): read again
        if static[-1] == analytic:
            break
        time.sleep(0.5)
        static.append(live_tensor_bytes() - base)
    return static[-1], analytic, shards, sorted(replicated.values())


def test_budget0_static_memory_excludes_the_table():
    """Budget 0 on 2 ranks before any step: each rank holds exactly its replicated parameters
    and buffers and its shards (analytic, no padding), and sharding the tied table saves rank 0
    its 8 KiB less its shard (row blocks of 5, 5 and 3 chunks, each chunk's slice 80 floats; the
    last chunk's 128 floats leave rank 0 a full slice: 4,160 bytes), nothing else."""
    on = run_distributed(_static_worker, 2, True, timeout=180)
    off = run_distributed(_static_worker, 2, False, timeout=180)
    for static, analytic, _, _ in on + off:
        assert static == analytic, (static, analytic)
    table = 64 * 32 * FP32
    assert table in off[0][3] and table not in on[0][3]
    assert off[0][0] - on[0][0] == table - 13 * 80 * FP32, (off[0][0], on[0][0])


# ------------------------------------------------------------------------ state dict, save, merge

def _tied_io_worker(rank, world_size, tmp):
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, merge_adapters

    plain = tiny("llama_tied")
    want = plain.state_dict()
    model = convert_to_elastic(tiny("llama_tied"), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                               ElasticPolicy(**BUDGET0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    sd = model.state_dict()
    assert sorted(k for k in sd if ".lora_" not in k) == sorted(want)
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"], "the tied keys are two gathered tensors"
    # load_state_dict puts each rank's shard back: a model of another seed becomes this one.
    other = convert_to_elastic(tiny("llama_tied", seed=1), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                               ElasticPolicy(**BUDGET0))
    other.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(other(input_ids=ids).logits, logits)
    # save_pretrained (a collective) -> a plain transformers model with the adapter attached.
    model.save_pretrained(os.path.join(tmp, "saved"))
    torch.distributed.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "saved")).float().eval()
    assert loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, **TOL)
    # merge_adapters: an nn.Embedding and an nn.Linear sharing one Parameter, same outputs.
    merged = merge_adapters(model)
    emb, head = merged.get_input_embeddings(), merged.get_output_embeddings()
    assert type(emb) is nn.Embedding and type(head) is nn.Linear
    assert head.weight is emb.weight and torch.equal(emb.weight, want["model.embed_tokens.weight"])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, logits, **TOL)
    return True


def test_tied_state_dict_save_and_merge(tmp_path):
    assert run_distributed(_tied_io_worker, 2, str(tmp_path), timeout=300) == [True, True]


def _num_params_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    out = []
    for kind in ("llama_tied", "llama_untied"):
        plain = tiny(kind)
        want = (plain.num_parameters(), plain.num_parameters(exclude_embeddings=True))
        model = convert_to_elastic(tiny(kind), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                                   ElasticPolicy(**BUDGET0))
        lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        out.append((want, (model.num_parameters() - lora, model.num_parameters(exclude_embeddings=True) - lora)))
    return out


def test_num_parameters_counts_the_table_once():
    for want, got in run_distributed(_num_params_worker, 2, timeout=180)[0]:
        assert got == want, (got, want)


def test_policy_switch_and_bad_ids():
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import ElasticEmbedding, LoRAConfig, convert_to_elastic

    with pytest.raises(ValueError, match="shard_embeddings must be True or False"):
        ElasticPolicy(shard_embeddings="yes")
    assert ElasticPolicy().shard_embeddings is False  # the default: [Note: embeddings under the runtime]
    default = convert_to_elastic(tiny("llama_tied"), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                                 ElasticPolicy(chunk_bytes=CHUNK, replicate_below_bytes=0))
    assert type(default.get_input_embeddings()) is nn.Embedding
    off = convert_to_elastic(tiny("llama_tied"), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                             ElasticPolicy(chunk_bytes=CHUNK, replicate_below_bytes=0, shard_embeddings=False))
    assert type(off.get_input_embeddings()) is nn.Embedding and type(off.get_output_embeddings()) is nn.Linear
    assert off.get_input_embeddings().weight is off.get_output_embeddings().weight
    small = convert_to_elastic(tiny("llama_tied"), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                               ElasticPolicy(chunk_bytes=CHUNK, replicate_below_bytes=64 * 32 * FP32 + 1,
                                             shard_embeddings=True))
    assert type(small.get_input_embeddings()) is nn.Embedding  # below replicate_below_bytes
    on = convert_to_elastic(tiny("llama_tied"), LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)),
                            ElasticPolicy(chunk_bytes=CHUNK, replicate_below_bytes=0, shard_embeddings=True))
    emb = on.get_input_embeddings()
    assert isinstance(emb, ElasticEmbedding)
    with pytest.raises(IndexError, match="token id 64 is out of range for an embedding of 64 rows"):
        emb(torch.tensor([[1, 64]]))
    with pytest.raises(TypeError, match="token ids must be int64 or int32"):
        emb(torch.tensor([[1.0]]))
    with pytest.raises(RuntimeError, match="cannot move or cast an elastic layer"):
        emb.to(torch.float64)


def test_tables_stay_full_precision_under_a_weight_format():
    """weight_format="nf4" with every linear quantized (quant_skip_modules=()): the tables, and
    the head tied to one, stay in full precision ([Note: embeddings under the runtime]); the
    other linears are quantized; a lookup is the table's rows, bit for bit."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, runtime_of

    for kind in ("llama_tied", "gpt2"):
        plain = tiny(kind)
        model = convert_to_elastic(tiny(kind), LoRAConfig(r=4, alpha=8, target_modules=TARGETS[kind]),
                                   ElasticPolicy(chunk_bytes=CHUNK, replicate_below_bytes=0, weight_format="nf4",
                                                 quant_skip_modules=(), shard_embeddings=True))
        formats = {et.name: et.weight_format for et in runtime_of(model).tensors}
        assert {formats[n] for n in TABLES[kind]} == {None}, formats
        assert {f for n, f in formats.items() if n not in TABLES[kind]} == {"nf4"}, formats
        assert model.get_output_embeddings().ets is model.get_input_embeddings().ets
        ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
        assert torch.equal(model.get_input_embeddings()(ids), plain.get_input_embeddings()(ids))
