"""Several named LoRA adapters on one converted model (issue 29, [Note: many adapters on one
base] in python_api/nn/lora.py): each adapter against the same adapter trained alone (its
solo run, itself checked against PEFT in test_lora.py), PEFT loading each saved adapter,
the frozen-weight bytes gathered, gradient isolation and the bad inputs.

Tolerance (TOL, the suite's fp32 one, 1e-4): the multi-adapter layer computes the base
product with the same chunking as the solo layer, but rounds the LoRA term and adds it
separately where the solo layer's fused op accumulates both in one buffer, and the row
permutation changes nothing else; so a logit differs by a few fp32 ulps of its magnitude per
layer (~1e-7 relative; measured below 4e-6 absolute on gradients of magnitude 20). AdamW
with its default eps (1e-8) turns a near-zero gradient into an update of about ±lr whatever
its rounding (m/sqrt(v) is its sign), so the steps use eps = 1e-3: an update then moves by at
most lr/eps = 1 per unit of gradient difference, lr = 1e-3 times a few 1e-6 per step.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed
from tests.nn.test_lora import TOL, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

CHUNK = 32 * 4 * 5  # 5 rows of the tiny model's 32 columns: divides no projection


def _configs(k):
    from elastic_kernels.api.nn import LoRAConfig

    all_ = {
        "a": LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
        "b": LoRAConfig(r=2, alpha=4, target_modules=("v_proj", "down_proj"), seed=3),
        "c": LoRAConfig(r=3, alpha=3, target_modules="all-linear", seed=5, rank_pattern={"o_proj": 5}),
        "d": LoRAConfig(r=8, alpha=16, target_modules=("up_proj",), seed=7, use_rslora=True),
    }
    return dict(list(all_.items())[:k])


def _randomize(models_params, seed):
    """Same non-zero values into matching parameter lists (B = 0 would hide the LoRA path)."""
    g = torch.Generator().manual_seed(seed)
    for ps, qs in models_params:
        assert len(ps) == len(qs)
        for p, q in zip(ps, qs):
            assert torch.equal(p, q), "an adapter must initialise as it does alone"
            v = torch.randn(p.shape, generator=g) * 0.1
            with torch.no_grad():
                p.copy_(v)
                q.copy_(v)


def _row_losses(logits, ids):
    """Per-row mean next-token cross entropy [B]."""
    lg = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(lg, ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(ids.shape[0], -1).mean(1)


def _parity_worker(rank, world_size, k, policy_kwargs, names_per_rank, steps, model_fn=None, configs=None):
    """Train K adapters in one model and each adapter alone (its own elastic model, same
    policy, same group) on the same rows, per-adapter AdamW; compare losses, gradients and
    parameters after every step, and the frozen-weight bytes gathered."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import (
        ElasticLoRALinear,
        ElasticMultiLoRALinear,
        LoRAConfig,
        adapter_parameters,
        convert_to_elastic,
        reset_stats,
        stats,
    )

    make = model_fn or tiny_llama
    cfgs = configs or _configs(k)
    policy = ElasticPolicy(chunk_bytes=CHUNK, **policy_kwargs)
    multi = convert_to_elastic(make(), cfgs, policy)
    solo = {n: convert_to_elastic(make(), c, policy) for n, c in cfgs.items()}
    # Which weights a backward re-gathers depends on which layers carry an adapter (dx is
    # needed from the first one on), so the K-adapter job's traffic is that of the
    # one-adapter job on the union of their targets (the adapters of a sweep share theirs).
    lora_layers = {n for n, m in multi.named_modules() if isinstance(m, ElasticMultiLoRALinear)}
    union = convert_to_elastic(make(), LoRAConfig(r=1, alpha=1, target_modules=tuple(sorted(lora_layers))), policy)
    same_targets = {n for n in cfgs
                    if {m for m, mod in solo[n].named_modules() if isinstance(mod, ElasticLoRALinear)} == lora_layers}
    _randomize([(adapter_parameters(multi, n), adapter_parameters(solo[n])) for n in cfgs], seed=1)
    opt_m = {n: torch.optim.AdamW(adapter_parameters(multi, n), lr=1e-3, eps=1e-3) for n in cfgs}
    opt_s = {n: torch.optim.AdamW(adapter_parameters(solo[n]), lr=1e-3, eps=1e-3) for n in cfgs}
    names = names_per_rank[rank]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
    vocab = multi.config.vocab_size
    gathered = {}
    for step in range(steps):
        ids = torch.randint(0, vocab, (len(names), 9), generator=gen)
        reset_stats(multi)
        out = multi(input_ids=ids, adapter_names=names)
        per_row = _row_losses(out.logits, ids)
        losses = {}
        # Each adapter's objective is the mean loss over its rows: the sum of those is one
        # backward whose gradient, adapter by adapter, is the solo run's.
        total = 0
        for n in cfgs:
            rows = [i for i, m in enumerate(names) if m == n]
            if rows:
                losses[n] = per_row[rows].mean()
                total = total + losses[n]
        total.backward()
        gathered["multi"] = stats(multi)["allgather_bytes"]
        for n in cfgs:
            rows = [i for i, m in enumerate(names) if m == n]
            reset_stats(solo[n])
            # An adapter without rows on this rank runs one row with weight 0: it contributes
            # zeros to the average over ranks, as the multi-adapter job's absent adapter does.
            sel = rows or [0]
            ref = _row_losses(solo[n](input_ids=ids[sel]).logits, ids[sel]).mean()
            (ref * (1.0 if rows else 0.0)).backward()
            gathered[n] = stats(solo[n])["allgather_bytes"]
            if rows:
                torch.testing.assert_close(losses[n], ref, **TOL, msg=lambda m: f"step {step} loss {n}: {m}")
            for p, q in zip(adapter_parameters(multi, n), adapter_parameters(solo[n])):
                if q.grad is None or (not rows and world_size == 1):
                    assert p.grad is None, f"{n}: absent adapter got a gradient"
                    continue
                assert p.grad is not None, f"step {step}: {n} has no gradient in the multi-adapter model"
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"step {step} grad {n}: {m}")
        reset_stats(union)
        union(input_ids=ids).logits.sum().backward()
        gathered["union"] = stats(union)["allgather_bytes"]
        # Exact traffic: the K-adapter step gathers the bytes of the one-adapter step.
        assert gathered["multi"] == gathered["union"], gathered
        for n in same_targets:
            assert gathered[n] == gathered["multi"], gathered
        for n in cfgs:
            opt_m[n].step()
            opt_s[n].step()
            opt_m[n].zero_grad(set_to_none=True)
            opt_s[n].zero_grad(set_to_none=True)
            for p, q in zip(adapter_parameters(multi, n), adapter_parameters(solo[n])):
                torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step} param {n}: {m}")
    return gathered["multi"]


def test_k1_named_adapter_matches_solo():
    run_distributed(_parity_worker, 1, 1, {}, [["a", "a"]], 2)


def test_k4_mixed_rows_match_solo_runs():
    names = [["c", "a", "d", "b", "a"]]
    run_distributed(_parity_worker, 1, 4, {}, names, 3)


def _sweep_configs():
    from elastic_kernels.api.nn import LoRAConfig

    t = ("q_proj", "v_proj", "o_proj")
    return {"r4": LoRAConfig(r=4, alpha=8, target_modules=t), "r8": LoRAConfig(r=8, alpha=8, target_modules=t, seed=1),
            "r2": LoRAConfig(r=2, alpha=16, target_modules=t, seed=2)}


def test_sweep_two_ranks_exact_bytes():
    """A sweep (same targets, other r/alpha/seed): every adapter's traffic equals the K-adapter
    job's, exactly, at budget 0 on 2 ranks."""
    policy = dict(keep_ratio=0.0, persist_ratio=0.0, pool_budget_bytes=0)
    got = run_distributed(_parity_worker, 2, 3, policy, [["r8", "r2", "r4"], ["r4", "r4", "r8"]], 2, None,
                          _sweep_configs(), timeout=240)
    assert all(g > 0 for g in got), got


def test_k2_two_ranks_adapter_absent_on_one_rank():
    """Rank 1 has no row of "b": its gradients reach rank 0's average as zeros
    ([Note: gradients absent on some ranks] in python_api/runtime/_grads.py)."""
    policy = dict(keep_ratio=0.5, persist_ratio=0.0, pool_budget_bytes=0, grad_bucket_bytes=256)
    got = run_distributed(_parity_worker, 2, 2, policy, [["a", "b", "a"], ["a", "a"]], 3, timeout=240)
    assert all(g > 0 for g in got), got  # something was gathered, and the same as alone (asserted above)


def test_k2_two_ranks_host_tier():
    policy = dict(weights_on="host", keep_ratio=0.0, persist_ratio=0.0)
    run_distributed(_parity_worker, 2, 2, policy, [["b", "a"], ["a", "b"]], 2, timeout=240)


def _tiny64():
    from tests.pipeline._common import tiny_model

    return tiny_model("llama", 2).float().eval()


def test_k2_nf4():
    """replicate_below_bytes=0: every linear elastic, so quantized, in every model. With the
    default, a small linear that adapter "a" alone leaves plain (full precision) is a LoRA
    target of "b" in the two-adapter model, hence nf4 there: another base for "a"'s rows."""
    policy = dict(weight_format="nf4", replicate_below_bytes=0)
    run_distributed(_parity_worker, 1, 2, policy, [["b", "a", "b"]], 2, _tiny64, timeout=240)


def _set_b(model, names, seed):
    """Non-zero B for every adapter (the same on every rank)."""
    from elastic_kernels.api.nn import adapter_parameters

    g = torch.Generator().manual_seed(seed)
    for n in names:
        for p in adapter_parameters(model, n)[1::2]:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _save_worker(rank, world_size, tmp):
    from peft import PeftModel

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import (
        adapter_parameters,
        convert_to_elastic,
        load_adapter,
        merge_adapters,
        save_adapter,
    )

    policy = ElasticPolicy(chunk_bytes=CHUNK)
    cfgs = _configs(3)
    multi = convert_to_elastic(tiny_llama(), cfgs, policy)
    _set_b(multi, cfgs, seed=5)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(6))
    save_adapter(multi, os.path.join(tmp, "all"))  # one folder per adapter
    save_adapter(multi, os.path.join(tmp, "one"), adapter="b")  # that one, in the folder itself
    assert sorted(os.listdir(os.path.join(tmp, "all"))) == ["a", "b", "c"]
    assert sorted(os.listdir(os.path.join(tmp, "one"))) == ["adapter_config.json", "adapter_model.safetensors"]
    mixed = ["c", "a", "b"]
    with torch.no_grad():
        got = multi(input_ids=ids, adapter_names=mixed).logits
        for n in cfgs:
            peft = PeftModel.from_pretrained(tiny_llama(), os.path.join(tmp, "all", n))
            want = peft(input_ids=ids).logits
            torch.testing.assert_close(multi(input_ids=ids, adapter_names=[n] * 3).logits, want, **TOL)
            for i in [i for i, m in enumerate(mixed) if m == n]:  # a mixed batch: each row its adapter's
                torch.testing.assert_close(got[i], want[i], **TOL, msg=lambda m: f"row {i} ({n}): {m}")
        one = PeftModel.from_pretrained(tiny_llama(), os.path.join(tmp, "one"))
        torch.testing.assert_close(one(input_ids=ids).logits, multi(input_ids=ids, adapter_names=["b"] * 3).logits, **TOL)

    # load_adapter: all of them from their folders, or one by name; the state dict names each.
    fresh = convert_to_elastic(tiny_llama(), cfgs, policy)
    load_adapter(fresh, os.path.join(tmp, "all"))
    for n in cfgs:
        assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(fresh, n), adapter_parameters(multi, n))), n
    other = convert_to_elastic(tiny_llama(), cfgs, policy)
    load_adapter(other, os.path.join(tmp, "one"), adapter="b")
    assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(other, "b"), adapter_parameters(multi, "b")))
    assert not any(torch.equal(p, q) for p, q in zip(adapter_parameters(other, "a")[1::2], adapter_parameters(multi, "a")[1::2]))
    with pytest.raises(ValueError, match=r"adapter 'zz' is not an adapter of this model; its adapters are \['a', 'b', 'c'\]"):
        load_adapter(other, os.path.join(tmp, "one"), adapter="zz")
    with pytest.raises(ValueError, match=r"for model.layers.0.self_attn.q_proj the adapter in .* has r=2, .*the model.s layer has r=3"):
        load_adapter(other, os.path.join(tmp, "one"), adapter="c")  # b's file, c's layers
    state = multi.state_dict()  # a collective, every rank
    assert "model.layers.0.self_attn.v_proj.lora_A.a.weight" in state
    assert "model.layers.0.self_attn.v_proj.lora_A.b.weight" in state
    assert "model.layers.0.self_attn.v_proj.weight" in state
    other.load_state_dict(state)
    for n in cfgs:
        assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(other, n), adapter_parameters(multi, n))), n
    # Merging one adapter: a plain model computing what that adapter's rows did.
    merged = merge_adapters(other, adapter="b")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, one(input_ids=ids).logits, **TOL)
        with pytest.raises(ValueError, match="the model's adapters were merged"):
            merged(input_ids=ids, adapter_names=["b"] * 3)
    return True


def test_per_adapter_saves_load_in_peft(tmp_path):
    assert run_distributed(_save_worker, 2, str(tmp_path), timeout=240) == [True, True]


def _isolation_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import adapter_parameters, convert_to_elastic, no_sync

    policy = ElasticPolicy(chunk_bytes=CHUNK, grad_bucket_bytes=512)
    cfgs = _configs(3)
    model = convert_to_elastic(tiny_llama(), cfgs, policy)
    _set_b(model, cfgs, seed=2)
    opts = {n: torch.optim.AdamW(adapter_parameters(model, n), lr=1e-2, weight_decay=0.1) for n in cfgs}
    before = {n: [p.detach().clone() for p in adapter_parameters(model, n)] for n in cfgs}
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    # "b" on no rank: no gradient at all, and its optimizer (weight decay too) leaves it as it was.
    model(input_ids=ids, labels=ids, adapter_names=["a", "c"] if rank == 0 else ["c", "c"]).loss.backward()
    assert all(p.grad is None for p in adapter_parameters(model, "b"))
    assert all(p.grad is not None for n in ("a", "c") for p in adapter_parameters(model, n))
    for opt in opts.values():
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(model, "b"), before["b"]))
    assert all(not torch.equal(p, q) for p, q in zip(adapter_parameters(model, "a"), before["a"]))
    # Accumulation: "b" in the first micro-batch of rank 0 only; after the step's reduction
    # every rank holds rank 0's gradient halved (rank 1 contributed zeros).
    with no_sync(model):
        model(input_ids=ids, labels=ids, adapter_names=["b", "a"] if rank == 0 else ["a", "a"]).loss.backward()
    local = [None if p.grad is None else p.grad.clone() for p in adapter_parameters(model, "b")]
    model(input_ids=ids, labels=ids, adapter_names=["a", "a"]).loss.backward()
    got = [p.grad for p in adapter_parameters(model, "b")]
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, local)
    for i, g in enumerate(got):
        torch.testing.assert_close(g, everyone[0][i] / world_size, rtol=0, atol=0)
    return True


def test_absent_adapter_gets_no_gradient_and_does_not_step():
    assert run_distributed(_isolation_worker, 2, timeout=240) == [True, True]


def test_gradient_checkpointing_recompute_uses_the_calls_rows():
    """HF gradient checkpointing runs the decoder layers again inside backward, after the
    model's call returned: the layers take the rows of that call."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import adapter_parameters, convert_to_elastic

    cfgs = _configs(2)
    models = [convert_to_elastic(tiny_llama(), cfgs, ElasticPolicy(chunk_bytes=CHUNK)) for _ in range(2)]
    models[1].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(0))
    for m in models:
        _set_b(m, cfgs, seed=4)
        m.train()
        m(input_ids=ids, labels=ids, adapter_names=["b", "a", "b"]).loss.backward()
    for n in cfgs:
        for p, q in zip(adapter_parameters(models[0], n), adapter_parameters(models[1], n)):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def _bad_input_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, merge_adapters, stats

    policy = ElasticPolicy(chunk_bytes=CHUNK)
    cfg = LoRAConfig(r=2, alpha=2, target_modules=("q_proj",))
    with pytest.raises(ValueError, match="adapter name 'a' is given twice"):
        convert_to_elastic(tiny_llama(), [("a", cfg), ("a", cfg)], policy)
    for bad in ("", "1a", "a.b", 3, None):
        with pytest.raises(ValueError, match=f"adapter name {bad!r} is not valid; a name must be a non-empty identifier"):
            convert_to_elastic(tiny_llama(), {bad: cfg}, policy)
    with pytest.raises(ValueError, match="no adapters given"):
        convert_to_elastic(tiny_llama(), {}, policy)
    with pytest.raises(TypeError, match=r"lora\['a'\] must be a LoRAConfig, got dict"):
        convert_to_elastic(tiny_llama(), {"a": {"r": 2}}, policy)
    with pytest.raises(ValueError, match="adapter 'b': LoRAConfig.target_modules=.*matches no nn.Linear"):
        convert_to_elastic(tiny_llama(), {"a": cfg, "b": LoRAConfig(r=2, alpha=2, target_modules=("nope",))}, policy)

    model = convert_to_elastic(tiny_llama(), {"a": cfg, "b": cfg}, policy)
    ids = torch.randint(0, 64, (3, 5))
    calls = stats(model)["allgather_calls"]
    cases = [
        ({}, r"the model has 2 adapters \['a', 'b'\]: say which one each row of the batch uses with "
             r"model\(\.\.\., adapter_names=\[\.\.\.\]\)"),
        # Only the last rank names an adapter that does not exist: every rank raises the same error.
        (dict(adapter_names=["a", "a", "zz" if rank == world_size - 1 else "b"]),
         r"adapter_names: \['zz'\] is not an adapter of this model; its adapters are \['a', 'b'\]"
         + (r" \(on rank 1\)" if world_size > 1 else "")),
        (dict(adapter_names=["a", "b"]), "adapter_names has 2 names but the batch has 3 rows; give one adapter name per row"),
        (dict(adapter_names="a"), "adapter_names must be a list of adapter names \\(str\\), one per row of the batch, got str"),
        (dict(adapter_names=["a", 1, "b"]), r"adapter_names must be a list .* got list holding \['int', 'str'\]"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            model(input_ids=ids, **kwargs)
        assert model._elastic_selection.current is None  # restored after the error
    assert stats(model)["allgather_calls"] == calls  # refused before any compute
    model(input_ids=ids, adapter_names=["a", "b", "a"])  # the model still works
    with pytest.raises(ValueError, match=r"merge_adapters: the model has adapters \['a', 'b'\]; name the one to merge"):
        merge_adapters(model)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input(world_size):
    assert run_distributed(_bad_input_worker, world_size, timeout=240) == [True] * world_size


@pytest.mark.parametrize("impl", ["loop", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_lora_pair_against_dense_float64(dtype, impl, monkeypatch):
    """segmented_lora_fwd / _bwd (the pair the layers call) against float64 autograd per
    segment, through the per-adapter loop (CPU) and through the segmented Triton kernels (what
    CUDA tensors take; here under the Triton interpreter): ragged segments (an empty one, one
    row, 7, 127), fp32 adapters with bf16 activations as the layers use them. Tolerance: fp32
    accumulation, so fp32 rounding for fp32 inputs; for bf16 the inputs are bf16 values (exact
    in float64) and xa, dyb are rounded to the fp32 adapters only, so the same fp32 bound
    holds, relative to the magnitudes."""
    from elastic_kernels.api.nn import lora, segmented_lora_bwd, segmented_lora_fwd

    monkeypatch.setattr(lora, "SEGMENTED_IMPL", impl)
    launches = _count_kernel_calls(monkeypatch)

    g = torch.Generator().manual_seed(0)
    sizes, ranks, scales = [0, 1, 7, 127], [2, 3, 5, 8], [0.5, 2.0, 1.0, 0.25]
    n_in, n_out = 33, 17
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    x = torch.randn(offsets[-1], n_in, generator=g).to(dtype)
    dy = torch.randn(offsets[-1], n_out, generator=g).to(dtype)
    mask = (torch.rand(offsets[-1], n_in, generator=g) > 0.3).float().div(0.7).to(dtype)
    a_s = [torch.randn(r, n_in, generator=g) * 0.2 for r in ranks]
    b_s = [torch.randn(n_out, r, generator=g) * 0.2 for r in ranks]
    lx = x * mask  # the op's input, rounded to `dtype` as the layer rounds it
    delta, xas = segmented_lora_fwd(lx, offsets, a_s, b_s, scales)
    dx, das, dbs = segmented_lora_bwd(dy, lx, xas, offsets, a_s, b_s, scales, mask, need_dx=True)
    assert delta.dtype == torch.float32 and dx.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5)
    for k, (r0, r1) in enumerate(zip(offsets, offsets[1:])):
        xk = lx[r0:r1].double().requires_grad_()
        a = a_s[k].double().requires_grad_()
        b = b_s[k].double().requires_grad_()
        ref = scales[k] * (xk @ a.t()) @ b.t()
        ref.backward(dy[r0:r1].double())
        torch.testing.assert_close(delta[r0:r1].double(), ref.detach(), **tol)
        torch.testing.assert_close(dx[r0:r1].double(), xk.grad * mask[r0:r1].double(), **tol)
        torch.testing.assert_close(das[k].double(), a.grad, **tol)
        torch.testing.assert_close(dbs[k].double(), b.grad, **tol)
        assert das[k].dtype == dbs[k].dtype == torch.float32
    assert launches == ({"fwd": 1, "bwd": 1} if impl == "triton" else {"fwd": 0, "bwd": 0})


def _count_kernel_calls(monkeypatch) -> dict:
    """Counts the layers' calls of the segmented kernels (so a test of the kernel path cannot
    pass on the loop)."""
    import elastic_kernels

    calls = {"fwd": 0, "bwd": 0}
    for which in calls:
        real = getattr(elastic_kernels, f"segmented_lora_{which}")

        def counted(*a, _real=real, _which=which, **k):
            calls[_which] += 1
            return _real(*a, **k)

        monkeypatch.setattr(elastic_kernels, f"segmented_lora_{which}", counted)
    return calls


def test_bf16_autocast_and_dropout_per_adapter():
    """Under bf16 autocast each adapter's rows match its solo run within bf16 rounding (the base
    and LoRA term are rounded to bf16 separately here: one more bf16 rounding per layer; on
    logits of magnitude 0.35 the solo run is 1.9e-3 from fp32 and the two runs 2.4e-3 apart,
    the bound is 8e-3), and dropout is each adapter's own: rows of an adapter without dropout match
    its solo run in training mode; rows of one with dropout change from call to call."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, adapter_parameters, convert_to_elastic

    cfgs = {"a": LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
            "d": LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"), dropout=0.5, seed=1)}
    policy = ElasticPolicy(chunk_bytes=CHUNK)
    multi = convert_to_elastic(tiny_llama(), cfgs, policy)
    solo = {n: convert_to_elastic(tiny_llama(), c, policy) for n, c in cfgs.items()}
    _randomize([(adapter_parameters(multi, n), adapter_parameters(solo[n])) for n in cfgs], seed=3)
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    names = ["d", "a", "a", "d"]
    for m in (multi, *solo.values()):
        m.eval()  # the converted layers are new modules, in training mode until told otherwise
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = multi(input_ids=ids, adapter_names=names).logits.float()
        for n in cfgs:
            rows = [i for i, m in enumerate(names) if m == n]
            want = solo[n](input_ids=ids[rows]).logits.float()
            torch.testing.assert_close(got[rows], want, rtol=2 ** -7, atol=8e-3)
    multi.train()
    solo["a"].train()
    with torch.no_grad():
        first = multi(input_ids=ids, adapter_names=names).logits
        second = multi(input_ids=ids, adapter_names=names).logits
        torch.testing.assert_close(first[[1, 2]], solo["a"](input_ids=ids[[1, 2]]).logits, **TOL)
        torch.testing.assert_close(first[[1, 2]], second[[1, 2]], rtol=0, atol=0)
    assert not torch.equal(first[[0, 3]], second[[0, 3]])


def test_layers_through_the_segmented_kernels_match_the_loop(monkeypatch):
    """The multi-adapter layers with the segmented Triton kernels (CUDA's path; here under the
    Triton interpreter) against the per-adapter loop: logits and every adapter gradient of a
    mixed batch within fp32 rounding (TOL), with an adapter of another rank on other targets."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, adapter_parameters, convert_to_elastic, lora

    cfgs = {"a": LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
            "b": LoRAConfig(r=2, alpha=4, target_modules=("v_proj", "o_proj"), seed=1)}
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(2))
    names = ["b", "a", "b"]
    out = {}
    launches = _count_kernel_calls(monkeypatch)
    for impl in ("loop", "triton"):
        monkeypatch.setattr(lora, "SEGMENTED_IMPL", impl)
        model = convert_to_elastic(tiny_llama(), cfgs, ElasticPolicy(chunk_bytes=CHUNK))
        _randomize([(adapter_parameters(model, n), adapter_parameters(model, n)) for n in cfgs], seed=4)
        logits = model(input_ids=ids, adapter_names=names).logits
        logits.square().mean().backward()
        out[impl] = (logits.detach(), [p.grad.clone() for n in cfgs for p in adapter_parameters(model, n)])
    # the triton pass launched the kernels in every multi-adapter layer (q, v, o), forward and backward
    assert launches["fwd"] >= 3 and launches["bwd"] >= 3, launches
    torch.testing.assert_close(out["triton"][0], out["loop"][0], **TOL)
    assert len(out["triton"][1]) == len(out["loop"][1]) > 0
    for got, want in zip(out["triton"][1], out["loop"][1]):
        assert want.abs().max() > 0  # every adapter has rows in the batch: a real gradient
        torch.testing.assert_close(got, want, **TOL)
