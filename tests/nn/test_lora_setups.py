"""Elastic LoRA layers in the setups Hugging Face users run them in, against PEFT: mixed
precision (torch.autocast, bf16 base weights with fp32 adapters, Trainer(bf16=True)),
torch.compile, PEFT's per-module rank_pattern / alpha_pattern, adapter-config validation,
and GPT-2's Conv1D layers. One process (world size 1) unless a test says otherwise.

[Note: bf16 tolerances]
In bf16 (8 significant bits, unit roundoff u = 2^-9) the elastic model and PEFT round in
different places (the paged ops round x·Wᵀ + s·xa·Bᵀ once, PEFT rounds the base product and
the sum separately; under autocast PEFT also rounds the fp32 adapters to bf16, the elastic
layers keep them fp32), so they do not agree bit for bit, and a fixed tolerance would have
to be guessed. Instead every bf16 quantity is compared with an fp32 reference (PEFT on the
same base weights upcast exactly to fp32, the same adapters, no autocast), and the elastic
error must be at most K_BF16 = 2 times PEFT's own error in the same precision:
    rel(ours, ref32) <= 2 · rel(peft_bf16, ref32),    rel(a, b) = ||a - b|| / ||b||.
Measured on this model the ratio is 0.6-1.4 (PEFT's relative error is 4e-3 to 1e-2, i.e.
a few u, as expected after a few bf16 layers). A real defect (a missing LoRA term, a wrong
scaling, an adapter rounded to bf16 where it should not be, a wrong chunk) moves the result
by far more than PEFT's rounding error and fails. The loss is bounded through the logits:
log_softmax moves by at most 2·max|Δz| when the logits z move by Δz, so
|loss - loss_ref| <= 2·max|logits - logits_ref| (+ fp32 noise).

fp32 tolerances: as in test_lora.py (rtol = atol = 1e-4: chunked GEMMs differ from one GEMM
only in summation order).
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import torch.nn as nn

from tests._dist import run_distributed
from tests.nn.test_lora import TARGETS, TOL, _copy_adapters_into_peft, _peft_of, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

K_BF16 = 2.0  # [Note: bf16 tolerances]
CHUNKED = dict(chunk_bytes=32 * 4 * 5, replicate_below_bytes=0)  # ragged chunks; lm_head elastic too


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _adapters(model, names, peft: bool):
    """{name: (A, B)} parameters of an elastic or a PEFT model."""
    out = {}
    for n in names:
        if peft:
            m = model.base_model.model.get_submodule(n)
            out[n] = (m.lora_A["default"].weight, m.lora_B["default"].weight)
        else:
            m = model.get_submodule(n)
            out[n] = (m.lora_A.weight, m.lora_B.weight)
    return out


def _within_k_of_peft(ours, peft, ref, what: str) -> None:
    e_ours, e_peft = _rel(ours, ref), _rel(peft, ref)
    assert e_ours <= K_BF16 * e_peft, f"{what}: error vs fp32 {e_ours:.3e} > {K_BF16} x PEFT's bf16 error {e_peft:.3e}"


def _bf16_vs_peft(ours_model, peft_model, ref_model, names, ids, autocast: bool) -> None:
    """Forward/backward all three models; check [Note: bf16 tolerances] for logits, loss and
    every adapter gradient."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ours_model(input_ids=ids, labels=ids)
        peft_out = peft_model(input_ids=ids, labels=ids)
    out.loss.backward()
    peft_out.loss.backward()
    ref = ref_model(input_ids=ids, labels=ids)
    ref.loss.backward()
    assert out.logits.dtype == torch.bfloat16 and peft_out.logits.dtype == torch.bfloat16
    _within_k_of_peft(out.logits, peft_out.logits, ref.logits, "logits")
    bound = 2 * (out.logits.double() - ref.logits.double()).abs().max().item() + 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= bound, (out.loss.item(), ref.loss.item(), bound)
    ours, theirs, want = _adapters(ours_model, names, False), _adapters(peft_model, names, True), _adapters(ref_model, names, True)
    for n in names:
        for i, ab in enumerate("AB"):
            assert ours[n][i].grad.dtype == torch.float32, f"{n}.lora_{ab}: gradient in {ours[n][i].grad.dtype}"
            _within_k_of_peft(ours[n][i].grad, theirs[n][i].grad, want[n][i].grad, f"{n}.lora_{ab}.grad")


# ---------------------------------------------------------------------------------------------
# 1. Mixed precision: autocast over an fp32 model; .to(dtype) refused
# ---------------------------------------------------------------------------------------------


def _autocast_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    base = tiny_llama()
    peft_model = _peft_of(base, 4, 8, TARGETS)  # fp32, run under the same autocast
    ref = _peft_of(base, 4, 8, TARGETS)  # fp32, no autocast
    elastic = convert_to_elastic(base, LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
    _copy_adapters_into_peft(elastic, peft_model)
    _copy_adapters_into_peft(elastic, ref)
    names = [n for n, _ in lora_layers(elastic)]
    assert type(elastic.lm_head).__name__ == "ElasticLinear"  # the non-LoRA elastic layer is covered too
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    _bf16_vs_peft(elastic, peft_model, ref, names, ids, autocast=True)
    # The dtypes stay as they were: autocast casts per use, never the stored weights.
    assert all(l.et.shard.dtype == torch.float32 and l.lora_A.weight.dtype == torch.float32 for _, l in lora_layers(elastic))
    return True


def test_autocast_bf16_over_fp32_model_matches_peft():
    assert run_distributed(_autocast_worker, 1, timeout=300) == [True]


def _partial_budget_worker(rank, world_size):
    """2 ranks, a partial budget (the first weights held whole as runs, the rest in pages),
    bf16 autocast over the fp32 model and HF gradient checkpointing (non-reentrant: each layer
    recomputed inside backward) at once, against PEFT under the same autocast."""
    from elastic_kernels.api import ElasticPolicy, runtime_of
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    base = tiny_llama()
    peft_model = _peft_of(base, 4, 8, TARGETS)
    ref = _peft_of(base, 4, 8, TARGETS)
    policy = ElasticPolicy(**CHUNKED)
    elastic = convert_to_elastic(base, LoRAConfig(r=4, alpha=8, target_modules=TARGETS), policy)
    rt = runtime_of(elastic)
    # A budget holding the first third of the weights whole ([Note: resident runs], "Partial
    # budgets"): the same on every rank (run_bytes is the whole weight's).
    budget = sum(et.run_bytes for et in rt.tensors[: len(rt.tensors) // 3])
    rt.set_pool_budget(budget)
    _copy_adapters_into_peft(elastic, peft_model)
    _copy_adapters_into_peft(elastic, ref)
    elastic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elastic.train()
    names = [n for n, _ in lora_layers(elastic)]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the first step fills the runs
        elastic(input_ids=ids, labels=ids).loss.backward()
    elastic.zero_grad(set_to_none=True)
    held = [et.run is not None and et.run.filled for et in rt.tensors]
    assert any(held) and not all(held), held
    _bf16_vs_peft(elastic, peft_model, ref, names, ids, autocast=True)
    return held


def test_partial_budget_with_autocast_and_checkpointing_matches_peft():
    helds = run_distributed(_partial_budget_worker, 2, timeout=300)
    assert helds[0] == helds[1]  # every rank holds the same weights whole


def _conversion_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    model = convert_to_elastic(tiny_llama(), LoRAConfig(r=2, alpha=4, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    # No-op conversions (what HF and Trainer call) pass silently and change nothing.
    assert model.to("cpu") is model and model.to(torch.float32) is model and model.float() is model
    model.to(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    errors = {}
    for what, convert in (
        ("to_bf16", lambda m: m.to(torch.bfloat16)),
        ("half", lambda m: m.half()),
        ("to_meta", lambda m: m.to("meta")),  # another device: the one other device a CPU box has
    ):
        fresh = convert_to_elastic(tiny_llama(), LoRAConfig(r=2, alpha=4, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
        try:
            convert(fresh)
            errors[what] = None
        except RuntimeError as e:
            errors[what] = str(e)
    # Outside autocast a dtype mismatch is still a clear error.
    try:
        model.model.layers[0].self_attn.q_proj(torch.randn(3, 32, dtype=torch.bfloat16))
        errors["mismatch"] = None
    except TypeError as e:
        errors["mismatch"] = str(e)
    return errors


def test_dtype_and_device_conversion_refused_noop_allowed():
    (errors,) = run_distributed(_conversion_worker, 1, timeout=300)
    for what, dtype_or_device in (("to_bf16", "torch.bfloat16"), ("half", "torch.float16"), ("to_meta", "meta")):
        msg = errors[what]
        assert msg is not None, f"{what}: no error"
        assert dtype_or_device in msg and "before convert_to_elastic" in msg and "torch.autocast" in msg, msg
    assert "input dtype torch.bfloat16 differs from the layer's weight dtype torch.float32" in errors["mismatch"]


# ---------------------------------------------------------------------------------------------
# 2. Adapter dtype: fp32 adapters on bf16 base weights
# ---------------------------------------------------------------------------------------------


def _bf16_base_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    base = tiny_llama().to(torch.bfloat16)
    peft_model = _peft_of(base, 4, 8, TARGETS)  # PEFT's default: fp32 adapters on bf16 layers
    ref = _peft_of(copy.deepcopy(base).float(), 4, 8, TARGETS)  # the same bf16 weights, exactly, in fp32
    elastic = convert_to_elastic(base, LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
    names = [n for n, _ in lora_layers(elastic)]
    assert all(p.dtype == torch.float32 for ab in _adapters(peft_model, names, True).values() for p in ab)
    assert all(p.dtype == torch.float32 for ab in _adapters(elastic, names, False).values() for p in ab)
    _copy_adapters_into_peft(elastic, peft_model)
    _copy_adapters_into_peft(elastic, ref)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    _bf16_vs_peft(elastic, peft_model, ref, names, ids, autocast=False)
    return True


def test_bf16_base_fp32_adapters_match_peft():
    assert run_distributed(_bf16_base_worker, 1, timeout=300) == [True]


def _adamw_worker(rank, world_size, autocast_adapter_dtype):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    lora = LoRAConfig(r=4, alpha=8, target_modules=TARGETS, autocast_adapter_dtype=autocast_adapter_dtype)
    elastic = convert_to_elastic(tiny_llama().to(torch.bfloat16), lora, ElasticPolicy(**CHUNKED))
    gen = torch.Generator().manual_seed(7)
    for _, layer in lora_layers(elastic):  # B = 0 would give A no gradient
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
    a_before = [l.lora_A.weight.detach().clone() for _, l in lora_layers(elastic)]
    params = [p for p in elastic.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    elastic(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    changed = sum(int((l.lora_A.weight != a).sum()) for (_, l), a in zip(lora_layers(elastic), a_before))
    total = sum(a.numel() for a in a_before)
    return changed / total, str(params[0].dtype)


def test_adamw_step_moves_fp32_adapters_on_bf16_base():
    """One AdamW step at lr 1e-5 moves every entry of A by ~1e-5 (Adam's first step is
    lr·sign(g)): below half a bf16 ulp for |A| > ~1.3e-3 (most of U(-0.18, 0.18)), far above
    an fp32 ulp. fp32 adapters (the default) move ~all entries; bf16 ones (the old behaviour,
    still available with autocast_adapter_dtype=False) move few."""
    ((frac32, dtype32),) = run_distributed(_adamw_worker, 1, True, timeout=300)
    ((frac16, dtype16),) = run_distributed(_adamw_worker, 1, False, timeout=300)
    assert dtype32 == "torch.float32" and dtype16 == "torch.bfloat16"
    assert frac32 > 0.99, frac32
    assert frac16 < 0.5, frac16


def _trainer_worker(rank, world_size, tmp, elastic: bool):
    from transformers import Trainer, TrainingArguments

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    ours = convert_to_elastic(tiny_llama(), LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
    peft_model = _peft_of(tiny_llama(), 4, 8, TARGETS)
    _copy_adapters_into_peft(ours, peft_model)  # the same (non-zero B) adapters in both runs
    model = ours if elastic else peft_model
    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 9), generator=gen)]
    args = TrainingArguments(
        output_dir=tmp, bf16=True, use_cpu=True, max_steps=4, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        lr_scheduler_type="constant", dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_bf16_cpu_trains_like_peft(tmp_path):
    """Trainer(bf16=True, use_cpu=True) runs the model under autocast(cpu, bf16) (accelerate)
    and steps AdamW on the adapters. Every logged loss agrees with PEFT's under the same
    Trainer, same data order and same initial adapters, within 4e-3: 2·max|Δlogits|
    ([Note: bf16 tolerances]) with max|Δlogits| ~2e-3 for logits of this model (|z| < 0.5,
    a few bf16 roundings of u = 2^-9); the adapters' updates (Adam, lr 1e-3, ~lr·sign(g) per
    entry) agree unless a gradient's sign flips under rounding. Measured: |Δloss| <= 2e-4."""
    (ours,) = run_distributed(_trainer_worker, 1, str(tmp_path / "ours"), True, timeout=300)
    (theirs,) = run_distributed(_trainer_worker, 1, str(tmp_path / "peft"), False, timeout=300)
    assert len(ours) == len(theirs) == 4, (ours, theirs)
    assert all(math.isfinite(x) for x in ours), ours
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 4e-3, (ours, theirs)


# ---------------------------------------------------------------------------------------------
# 4. torch.compile
# ---------------------------------------------------------------------------------------------


def _compile_worker(rank, world_size, backend):
    import torch._dynamo

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    model = convert_to_elastic(tiny_llama(), LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
    _copy_adapters_into_peft(model, _peft_of(tiny_llama(), 4, 8, TARGETS))  # non-zero B
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))

    def step(m):
        for p in params:
            p.grad = None
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    want_loss, want_grads = step(model)
    graphs = []
    if backend == "eager":
        def counting(gm, example_inputs):  # the "eager" backend, counting what dynamo compiled
            graphs.append(gm)
            return gm.forward
        compiled = torch.compile(model, backend=counting)
    else:
        compiled = torch.compile(model, backend=backend)
    torch._dynamo.reset()
    results = []
    for _ in range(2):  # the second call runs the cached graphs
        loss, grads = step(compiled)
        results.append((loss, grads))
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")}
    return want_loss, want_grads, results, len(graphs), sorted(ops)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend):
    """The elastic layers break the graph ([Note: torch.compile] in python_api/nn/linear.py); the
    rest compiles. Tolerance: "eager" runs the very ops eager runs, so the results must be
    bit-identical; "aot_eager" runs decomposed ATen ops (RMSNorm, softmax, SiLU split into
    primitives) and "inductor" fused C++ kernels, which may reorder fp32 reductions:
    rtol = atol = 1e-5 (a few fp32 roundings through 2 layers; measured with inductor: loss
    1.2e-7 relative, gradients 4e-7; a wrong or missing term changes results at 1e-2).
    inductor compiles C++ for the CPU: about a minute here."""
    want_loss, want_grads, results, n_graphs, ops = run_distributed(_compile_worker, 1, backend, timeout=600)[0]
    tol = dict(rtol=0, atol=0) if backend == "eager" else dict(rtol=1e-5, atol=1e-5)
    for loss, grads in results:
        torch.testing.assert_close(loss, want_loss, **tol)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, **tol)
    if backend == "eager":
        # Graphs between the elastic layers were compiled: attention, RMSNorm and the MLP's
        # activation are in them, the elastic layers are not.
        assert n_graphs >= 2, n_graphs
        joined = " ".join(ops)
        for op in ("scaled_dot_product_attention", "silu", "pow", "mean"):  # attention, MLP, RMSNorm
            assert op in joined, (op, ops)
        assert not any("Elastic" in o for o in ops), ops


def _saved_tensor_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    model = convert_to_elastic(tiny_llama(), LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**CHUNKED))
    layer = model.model.layers[0].self_attn.q_proj
    out = {}
    for what, x in (("3d", torch.randn(2, 5, 32, requires_grad=True)),
                    ("view", torch.randn(5, 2, 32).transpose(0, 1).requires_grad_())):
        y = layer(x)
        saved = [t for t in y.grad_fn.saved_tensors if t is not None]
        out[what] = [(t is x, t._is_view()) for t in saved]
    return out


def test_lora_function_saves_no_view_of_its_input():
    """AOTAutograd refuses a saved intermediate that aliases an input ("intermediate tensor
    'x2' ... aliases an input"): the function saves x itself or a fresh tensor, never a view."""
    (out,) = run_distributed(_saved_tensor_worker, 1, timeout=120)
    for what, saved in out.items():
        assert all(is_input or not is_view for is_input, is_view in saved), (what, saved)


# ---------------------------------------------------------------------------------------------
# 12. GPT-2: transformers Conv1D layers
# ---------------------------------------------------------------------------------------------


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).float().eval()


def _gpt2_worker(rank, world_size, tmp):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import (
        ElasticLoRALinear,
        LoRAConfig,
        convert_to_elastic,
        load_adapter,
        lora_layers,
        merge_adapters,
        save_adapter,
    )

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    report = {}
    for targets, policy in (("all-linear", dict(chunk_bytes=32 * 4 * 5)),
                            (("c_attn",), dict(chunk_bytes=32 * 4 * 5, replicate_below_bytes=0))):
        peft_model = get_peft_model(tiny_gpt2(), LoraConfig(
            r=4, lora_alpha=8, target_modules=targets if isinstance(targets, str) else list(targets), lora_dropout=0.0))
        elastic = convert_to_elastic(tiny_gpt2(), LoRAConfig(r=4, alpha=8, target_modules=targets), ElasticPolicy(**policy))
        names = [n for n, _ in lora_layers(elastic)]
        theirs = sorted(n for n, m in peft_model.base_model.model.named_modules() if hasattr(m, "lora_A"))
        assert sorted(names) == theirs, (names, theirs)
        kinds = sorted({type(m).__name__ for n, m in elastic.named_modules() if n.endswith(("c_attn", "c_proj", "c_fc"))})
        report[str(targets)] = kinds
        _copy_adapters_into_peft(elastic, peft_model)
        out = elastic(input_ids=ids, labels=ids)
        ref = peft_model(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        torch.testing.assert_close(out.loss, ref.loss, **TOL)
        out.loss.backward()
        ref.loss.backward()
        ours, want = _adapters(elastic, names, False), _adapters(peft_model, names, True)
        for n in names:
            for i in range(2):
                torch.testing.assert_close(ours[n][i].grad, want[n][i].grad, **TOL, msg=lambda m: f"{n}: {m}")

    # Round trips with PEFT (the "all-linear" adapters are enough: every Conv1D kind is in them).
    lora = LoRAConfig(r=4, alpha=8, target_modules="all-linear")
    policy = ElasticPolicy(chunk_bytes=32 * 4 * 5)
    elastic = convert_to_elastic(tiny_gpt2(), lora, policy)
    peft_model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    _copy_adapters_into_peft(elastic, peft_model, seed=11)
    with torch.no_grad():
        want = elastic(input_ids=ids).logits
    save_adapter(elastic, os.path.join(tmp, "ours"))
    with open(os.path.join(tmp, "ours", "adapter_config.json")) as f:
        report["fan_in_fan_out"] = json.load(f)["fan_in_fan_out"]
    loaded = PeftModel.from_pretrained(tiny_gpt2(), os.path.join(tmp, "ours"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, **TOL)
    if rank == 0:
        peft_model.save_pretrained(os.path.join(tmp, "theirs"))
    torch.distributed.barrier()
    with open(os.path.join(tmp, "theirs", "adapter_config.json")) as f:
        report["peft_fan_in_fan_out"] = json.load(f)["fan_in_fan_out"]
    fresh = convert_to_elastic(tiny_gpt2(), lora, policy)
    load_adapter(fresh, os.path.join(tmp, "theirs"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, peft_model(input_ids=ids).logits, **TOL)
    # Merged: Conv1D layers again (the model's own layout), same outputs.
    merged = merge_adapters(elastic)
    assert not any(isinstance(m, ElasticLoRALinear) for m in merged.modules())
    attn = merged.transformer.h[0].attn.c_attn
    assert isinstance(attn, Conv1D) and tuple(attn.weight.shape) == (32, 96), (type(attn), attn.weight.shape)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, **TOL)
    return report


def test_gpt2_conv1d_matches_peft_and_round_trips(tmp_path):
    """GPT-2's c_attn / c_proj / c_fc are transformers Conv1D (weight [in, out]): as LoRA
    targets ("all-linear" and by name) and as non-target elastic layers, on 2 ranks with ragged
    chunks of the transposed weights. fp32 tolerances as in test_lora.py."""
    reports = run_distributed(_gpt2_worker, 2, str(tmp_path), timeout=300)
    report = reports[0]
    assert report["all-linear"] == ["ElasticLoRALinear"], report
    assert report["('c_attn',)"] == ["ElasticLinear", "ElasticLoRALinear"], report  # c_proj, c_fc elastic, no LoRA
    assert report["fan_in_fan_out"] is True and report["peft_fan_in_fan_out"] is True, report


# ---------------------------------------------------------------------------------------------
# 6. load_adapter: PEFT's rank_pattern / alpha_pattern; adapter-config validation
# ---------------------------------------------------------------------------------------------

RANK_PATTERN = {"v_proj": 2}
ALPHA_PATTERN = {"layers.1.self_attn.q_proj": 32, "down_proj": 3}


def _pattern_worker(rank, world_size, tmp):
    from peft import LoraConfig, PeftModel, get_peft_model

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, load_adapter, lora_layers, save_adapter

    policy = ElasticPolicy(**CHUNKED)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    peft_model = get_peft_model(tiny_llama(), LoraConfig(
        r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0,
        rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN))
    lora = LoRAConfig(r=4, alpha=8, target_modules=TARGETS, rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN)
    elastic = convert_to_elastic(tiny_llama(), lora, policy)
    per_module = {n: (l.r, l.scaling) for n, l in lora_layers(elastic)}
    want_peft = {n: (m.r["default"], m.scaling["default"]) for n, m in peft_model.base_model.model.named_modules()
                 if hasattr(m, "lora_A")}
    assert per_module == want_peft, (per_module, want_peft)
    _copy_adapters_into_peft(elastic, peft_model, seed=11)
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        torch.testing.assert_close(elastic(input_ids=ids).logits, want, **TOL)
    if rank == 0:
        peft_model.save_pretrained(os.path.join(tmp, "theirs"))
    # PEFT -> elastic, into a model converted with the same patterns.
    fresh = convert_to_elastic(tiny_llama(), lora, policy)
    load_adapter(fresh, os.path.join(tmp, "theirs"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, want, **TOL)
    # elastic -> PEFT: the patterns travel in adapter_config.json.
    save_adapter(elastic, os.path.join(tmp, "ours"))
    loaded = PeftModel.from_pretrained(tiny_llama(), os.path.join(tmp, "ours"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, **TOL)
    # A pattern file into a model converted without the patterns: refused, nothing changed
    # (it used to load and give logits off by 0.36).
    errors = {}
    for what, cfg in (("alpha_only", LoRAConfig(r=4, alpha=8, target_modules=TARGETS, rank_pattern=RANK_PATTERN)),
                      ("no_patterns", LoRAConfig(r=4, alpha=8, target_modules=TARGETS))):
        plain = convert_to_elastic(tiny_llama(), cfg, policy)
        before = [p.detach().clone() for p in plain.parameters() if p.requires_grad]
        try:
            load_adapter(plain, os.path.join(tmp, "theirs"))
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
        assert all(torch.equal(a, b) for a, b in zip(before, [p for p in plain.parameters() if p.requires_grad]))
    return errors


def test_load_adapter_rank_and_alpha_patterns_match_peft(tmp_path):
    """Per-module r and alpha ([Note: per-module rank and alpha] in lora.py) give PEFT's
    r and scaling for every module and PEFT's logits (fp32 tolerance), both ways through the
    saved files; a pattern file that disagrees with the model is refused, naming the module."""
    (errors,) = run_distributed(_pattern_worker, 1, str(tmp_path), timeout=300)
    # The first module that disagrees, in the model's order.
    assert errors["alpha_only"] is not None and "model.layers.0.mlp.down_proj" in errors["alpha_only"], errors
    assert "scaling=0.75" in errors["alpha_only"] and "alpha_pattern" in errors["alpha_only"], errors
    assert errors["no_patterns"] is not None and "model.layers.0.self_attn.v_proj" in errors["no_patterns"], errors
    assert "r=2" in errors["no_patterns"] and "r=4" in errors["no_patterns"], errors


def _validation_worker(rank, world_size, tmp):
    from safetensors.torch import load_file, save_file

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, load_adapter, save_adapter

    lora = LoRAConfig(r=4, alpha=8, target_modules=TARGETS)
    model = convert_to_elastic(tiny_llama(), lora, ElasticPolicy(**CHUNKED))
    good = os.path.join(tmp, "good")
    save_adapter(model, good)
    with open(os.path.join(good, "adapter_config.json")) as f:
        config = json.load(f)
    state = load_file(os.path.join(good, "adapter_model.safetensors"))
    nan_key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    def variant(name, cfg=None, tensors=None):
        folder = os.path.join(tmp, name)
        os.makedirs(folder)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config if cfg is None else cfg, f)  # writes NaN / Infinity as Python's json does
        save_file(state if tensors is None else tensors, os.path.join(folder, "adapter_model.safetensors"))
        return folder

    cases = {
        "missing_r": variant("missing_r", {k: v for k, v in config.items() if k != "r"}),
        "r_zero": variant("r_zero", {**config, "r": 0}),
        "not_a_dict": variant("not_a_dict", [config]),
        "alpha_nan": variant("alpha_nan", {**config, "lora_alpha": float("nan")}),
        "alpha_inf": variant("alpha_inf", {**config, "lora_alpha": float("inf")}),
        "pattern_not_dict": variant("pattern_not_dict", {**config, "alpha_pattern": [["q_proj", 4]]}),
        "pattern_nan": variant("pattern_nan", {**config, "alpha_pattern": {"q_proj": float("nan")}}),
        "nan_tensor": variant("nan_tensor", tensors={**state, nan_key: torch.full_like(state[nan_key], float("nan"))}),
    }
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)  # differs from the files, so a partial load would show
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    errors = {}
    for what, folder in cases.items():
        try:
            load_adapter(model, folder)
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
        except Exception as e:  # noqa: BLE001 - a KeyError/TypeError is a failure of the test, reported as such
            errors[what] = f"{type(e).__name__} (not ValueError): {e}"
        assert all(torch.equal(a, b) for a, b in zip(before, [p for p in model.parameters() if p.requires_grad])), what
    load_adapter(model, good)  # and the good one still loads
    return errors


def test_load_adapter_validates_before_touching_the_model(tmp_path):
    (errors,) = run_distributed(_validation_worker, 1, str(tmp_path), timeout=300)
    expect = {
        "missing_r": ("adapter_config.json", "no 'r'"),
        "r_zero": ("adapter_config.json", "r=0"),
        "not_a_dict": ("adapter_config.json", "JSON object"),
        "alpha_nan": ("adapter_config.json", "lora_alpha=nan"),
        "alpha_inf": ("adapter_config.json", "lora_alpha=inf"),
        "pattern_not_dict": ("adapter_config.json", "alpha_pattern="),
        "pattern_nan": ("adapter_config.json", "alpha_pattern['q_proj']"),
        "nan_tensor": ("adapter_model.safetensors", "layers.1.self_attn.v_proj.lora_B.weight"),
    }
    for what, parts in expect.items():
        msg = errors[what]
        assert msg is not None and "not ValueError" not in msg, (what, msg)
        for part in parts:
            assert part in msg, (what, part, msg)
    from elastic_kernels.api.nn import LoRAConfig

    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="alpha must be a finite positive number"):
            LoRAConfig(r=4, alpha=bad)
    with pytest.raises(ValueError, match=r"rank_pattern\['v_proj'\] must be a positive int"):
        LoRAConfig(r=4, alpha=8, rank_pattern={"v_proj": 0})


# ---------------------------------------------------------------------------------------------
# The dropout path in every dtype setup, against a float64 reference with the same mask
# ---------------------------------------------------------------------------------------------


def _dropout_worker(rank, world_size, setup):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import ElasticLoRALinear, LoRAConfig

    weight_dtype = torch.bfloat16 if setup == "bf16_base" else torch.float32
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=True).to(weight_dtype)
    layer = ElasticLoRALinear.from_linear(linear, LoRAConfig(r=4, alpha=8, dropout=0.5), ElasticPolicy(chunk_bytes=48 * 4 * 7))
    layer.train()
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape) * 0.1)
    op = torch.float32 if setup == "fp32" else torch.bfloat16
    x = torch.randn(3, 5, 48, dtype=weight_dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(setup == "autocast")):
        y = layer(x)
    mask = y.grad_fn.saved_tensors[4].double()
    dy = torch.randn(y.shape, dtype=y.dtype)
    y.backward(dy)
    # float64 reference on the values the layer computes with (x and W in the op dtype).
    x64 = x.detach().to(op).double().requires_grad_()
    a64 = layer.lora_A.weight.detach().double().requires_grad_()
    b64 = layer.lora_B.weight.detach().double().requires_grad_()
    w64, bias64 = linear.weight.detach().to(op).double(), linear.bias.detach().to(op).double()
    y64 = x64 @ w64.t() + bias64 + layer.scaling * ((x64 * mask) @ a64.t()) @ b64.t()
    y64.backward(dy.double())
    return {
        "dtypes": (str(y.dtype), str(x.grad.dtype), str(layer.lora_A.weight.grad.dtype)),
        "mask_fraction": (mask == 0).double().mean().item(),
        "y": _rel(y, y64), "dx": _rel(x.grad, x64.grad),
        "dA": _rel(layer.lora_A.weight.grad, a64.grad), "dB": _rel(layer.lora_B.weight.grad, b64.grad),
    }


@pytest.mark.parametrize("setup", ["fp32", "bf16_base", "autocast"])
def test_dropout_path_in_each_precision(setup):
    """The masked LoRA path (forward and the separate dgrad branch) with fp32 weights, bf16
    weights with fp32 adapters, and fp32 weights under autocast(bf16). Against float64 on the
    same inputs: y and dx are rounded once to the op dtype from an fp32 sum, so their relative
    error is at most about u (2^-24 in fp32, 2^-9 in bf16): bound 4u (measured 0.85u in
    bf16). The fp32 adapter gradients accumulate exact products of bf16 values in fp32:
    bound 1e-6, ~16 fp32 u (measured 1.4e-7)."""
    (r,) = run_distributed(_dropout_worker, 1, setup, timeout=120)
    u = 2.0 ** -24 if setup == "fp32" else 2.0 ** -9
    act = "torch.float32" if setup == "fp32" else "torch.bfloat16"
    want_dx = "torch.bfloat16" if setup == "bf16_base" else "torch.float32"
    assert r["dtypes"] == (act, want_dx, "torch.float32"), r
    assert 0.3 < r["mask_fraction"] < 0.7, r  # dropout p = 0.5 really dropped
    for key in ("y", "dx"):
        assert r[key] <= 4 * u + 1e-6, r  # (1e-6: fp32 accumulation over 48 terms, fp32 setup)
    for key in ("dA", "dB"):
        assert r[key] <= 1e-6, r
