"""Activation offload (python_api/host/offload.py, [Note: activation offload]).

Parity is bit for bit (fp32 and bf16 autocast on CPU) between the same model run with
`offload_activations` on and off, same ranks, same data, same RNG: offloading only copies
bytes, so not one bit may change. Traffic is checked against its analytic value (the bytes of
the activations every elastic LoRA layer saves), the budget against the pool's documented
greedy rule, steady state by counting host allocations, and lifetime by the bytes in use.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests._dist import run_distributed
from tests.nn.test_lora import tiny_llama

pytestmark = [pytest.mark.needs_ext]

TARGETS = ("q_proj", "v_proj", "down_proj")
R = 4
BATCH, SEQ = 2, 9
HIDDEN, INTER, LAYERS = 32, 48, 2  # tiny_llama's shape
IN_FEATURES = {"q_proj": HIDDEN, "v_proj": HIDDEN, "down_proj": INTER}
CHUNKED = dict(chunk_bytes=32 * 4 * 5, replicate_below_bytes=0)  # ragged chunks; lm_head elastic too


def _build(dropout: float, offload: bool, **policy):
    from python_api import ElasticPolicy, LoRAConfig, convert_to_elastic

    model = convert_to_elastic(
        tiny_llama(), LoRAConfig(r=R, alpha=8, dropout=dropout, target_modules=TARGETS),
        ElasticPolicy(**CHUNKED, offload_activations=offload, **policy),
    )
    gen = torch.Generator().manual_seed(7)  # B = 0 would hide the LoRA path from every gradient
    for _, layer in lora_layers(model):
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
    return model.train()


def lora_layers(model):
    from python_api.nn import lora_layers as layers

    return layers(model)


def _offloader(model):
    from python_api import runtime_of

    return runtime_of(model).activation_offload


def _saved_bytes_per_forward(act_bytes: int, xa_bytes: int, dropout: bool) -> list[int]:
    """The bytes of each activation the LoRA layers save, in forward order (lora_x, xa, mask
    per layer): T tokens, lora_x/mask [T, in] in the op dtype, xa [T, r] in the adapters'."""
    t = BATCH * SEQ
    out = []
    for _ in range(LAYERS):
        for name in TARGETS:  # the order the decoder layer calls them
            out += [t * IN_FEATURES[name] * act_bytes, t * R * xa_bytes]
            if dropout:
                out.append(t * IN_FEATURES[name] * act_bytes)
    return out


def _step(model, ids, micro: int, seed: int, autocast: bool):
    """One optimizer step's worth: `micro` micro-batches, each forward + backward, gradients
    accumulated (the runtime's no_sync for all but the last). Returns the losses."""
    from python_api import no_sync

    losses = []
    for m in range(micro):
        torch.manual_seed(seed * 100 + m)  # dropout masks: the same draw with offload on and off
        ctx = no_sync(model) if m < micro - 1 else torch.enable_grad()
        with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids[m], labels=ids[m]).loss
        loss.backward()
        losses.append(loss.detach())
    return losses


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------ parity, traffic


CONFIGS = [  # (dropout, checkpointing, autocast, more policy)
    (0.0, None, False, {}),
    (0.1, None, False, {}),
    (0.1, None, True, {}),
    (0.0, "non-reentrant", False, {}),
    (0.1, "reentrant", False, {}),
    (0.1, None, False, dict(weights_on="host")),  # with the host store: its own budget is apart
]


def _parity_worker(rank, world_size, steps: int, micro: int):
    out = []
    for dropout, ckpt, autocast, policy in CONFIGS:
        models = {flag: _build(dropout, flag, **policy) for flag in (False, True)}
        for m in models.values():
            if ckpt is not None:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
                m.enable_input_require_grads()
        off = None
        rows = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
            ids = [torch.randint(0, 64, (BATCH, SEQ), generator=gen) for _ in range(micro)]
            res = {}
            for flag, m in models.items():
                if flag and off is not None:
                    off.reset_stats()
                losses = _step(m, ids, micro, seed=step * 7 + rank, autocast=autocast)
                res[flag] = (losses, _grads(m))
                for p in m.parameters():
                    p.grad = None
            off = _offloader(models[True])
            rows.append(dict(
                losses_equal=all(torch.equal(a, b) for a, b in zip(res[False][0], res[True][0])),
                grads_equal=len(res[False][1]) > 0 and all(torch.equal(a, b) for a, b in zip(res[False][1], res[True][1])),
                stats=off.stats(detail=True),
                off_model_has_no_offloader=_offloader(models[False]) is None,
            ))
        out.append(rows)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_parity_and_traffic_offload_on_vs_off(world_size):
    """Losses and adapter gradients bit-identical with offload on and off over several steps of
    two micro-batches (gradient accumulation), with and without dropout, fp32 and bf16 autocast,
    with reentrant and non-reentrant gradient checkpointing, with the host store
    (weights_on="host"). Unlimited budget: d2h per step is
    the analytic bytes of the saved activations, h2d equals it, every buffer is back in the pool
    after each step, and no host buffer is allocated after step 1. Checkpointed layers offload
    nothing (the checkpointed forward's tensors are dropped, the recompute's are used at once)."""
    steps, micro = 3, 2
    for rows in run_distributed(_parity_worker, world_size, steps, micro, timeout=600):
        for (dropout, ckpt, autocast, policy), per_step in zip(CONFIGS, rows):
            what = f"dropout={dropout} ckpt={ckpt} autocast={autocast} {policy}"
            # bf16 autocast: lora_x and the mask in bf16, xa in the fp32 adapters' dtype.
            expected = micro * sum(_saved_bytes_per_forward(2 if autocast else 4, 4, dropout > 0))
            allocations = per_step[0]["stats"]["host_allocations"]
            for step, row in enumerate(per_step):
                s = row["stats"]
                assert row["losses_equal"], f"{what} step {step}: losses differ"
                assert row["grads_equal"], f"{what} step {step}: adapter gradients differ"
                assert row["off_model_has_no_offloader"]
                if ckpt is None:
                    assert s["d2h_bytes"] == expected, (what, step, s, expected)
                    assert s["offloaded_tensors"] > 0 and s["kept_tensors"] == 0, (what, s)
                else:
                    assert s["d2h_bytes"] == 0 and s["offloaded_tensors"] == 0, (what, s)
                assert s["h2d_bytes"] == s["d2h_bytes"], (what, step, s)
                assert s["host_in_use_bytes"] == 0, (what, step, s)  # every buffer returned
                assert s["host_allocations"] == allocations, (what, step, s)  # steady state
                assert s["host_pinned_bytes"] == (0 if ckpt else s["host_pinned_bytes"])
            if ckpt is None:
                # One forward's worth of buffers (micro-batches run one after the other).
                from python_api.host.offload import size_class

                held = sum(size_class(b) for b in _saved_bytes_per_forward(2 if autocast else 4, 4, dropout > 0))
                assert per_step[-1]["stats"]["host_pinned_bytes"] == held, (what, per_step[-1]["stats"], held)


# ------------------------------------------------------------------------------ budget


def _expected_kept(sizes: list[int], budget: int) -> list[bool]:
    """The pool's rule in the first step (all buffers busy until backward): in forward order a
    tensor is offloaded iff a new buffer of its class fits under the budget."""
    from python_api.host.offload import size_class

    held, kept = 0, []
    for n in sizes:
        cap = size_class(n)
        if held + cap <= budget:
            held += cap
            kept.append(False)
        else:
            kept.append(True)
    return kept


def _budget_worker(rank, world_size, budget: int, steps: int):
    from python_api import reset_stats, stats
    from python_api.nn import ElasticLoRAFunction

    ref, model = _build(0.0, False), _build(0.0, True, host_budget_bytes=budget)
    nodes = []

    def grab(module, args, output):
        assert output.grad_fn is not None and output.grad_fn.__class__.__name__.startswith(ElasticLoRAFunction.__name__)
        nodes.append(output.grad_fn)

    for _, layer in lora_layers(model):
        layer.register_forward_hook(grab)
    rows = []
    for step in range(steps):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step + 10 * rank))
        reset_stats(model)  # the runtime's reset resets the offloader's counters too
        nodes.clear()
        loss = model(input_ids=ids, labels=ids).loss
        # Which activations stayed on the device: the saved slots that are not None
        # (lora_x, xa, A, B, mask; offloaded ones are saved as None).
        on_device = []
        for node in nodes:
            lora_x, xa, _, _, mask = node.saved_tensors
            on_device += [lora_x is not None, xa is not None]
        nodes.clear()
        loss.backward()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        same = torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(ref)))
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
        s = _offloader(model).stats(detail=True)
        merged = stats(model)  # the runtime's stats carry the offloader's counters
        assert all(merged[k] == s[k] for k in ("d2h_bytes", "h2d_bytes", "host_pinned_bytes")), (merged, s)
        rows.append((on_device, same, s))
    return rows


@pytest.mark.distributed
def test_budget_keeps_exactly_the_expected_tensors_on_device():
    """A budget that holds part of one forward's activations: in every step exactly the
    tensors the pool's rule predicts stay on the device, the rest are offloaded, the gradients
    are bit-identical to offload off, the held bytes never exceed the budget, and step 2 on
    allocates nothing."""
    from python_api.host.offload import size_class

    sizes = _saved_bytes_per_forward(4, 4, False)
    classes = sorted({size_class(n) for n in sizes})
    assert classes == [512, 4096], classes  # lora_x: 2304 / 3456 bytes, xa: 288
    # Room for two big and four small buffers: the first big ones fit, then only small ones.
    budget = 2 * 4096 + 4 * 512
    expected = _expected_kept(sizes, budget)
    assert 0 < sum(expected) < len(expected) and not all(expected[len(expected) // 2:]), expected
    (rows,) = run_distributed(_budget_worker, 1, budget, 3, timeout=300)
    allocations = rows[0][2]["host_allocations"]
    for step, (on_device, same, s) in enumerate(rows):
        assert on_device == expected, (step, on_device, expected)
        assert same, f"step {step}: losses or gradients differ from offload off"
        assert s["host_pinned_bytes"] <= budget
        assert s["kept_tensors"] == sum(expected) and s["offloaded_tensors"] == len(expected) - sum(expected)
        assert s["d2h_bytes"] == s["h2d_bytes"] == sum(n for n, k in zip(sizes, expected) if not k), s
        assert s["host_allocations"] == allocations and s["host_in_use_bytes"] == 0, (step, s)


def test_zero_budget_offloads_nothing_and_bad_budget_is_refused():
    """host_budget_bytes=0 offloads nothing (every tensor counted as kept); a budget smaller
    than one host buffer is refused with a clear error when the model is wrapped."""
    from python_api import ElasticPolicy
    from python_api.host.offload import MIN_HOST_BUFFER_BYTES, ActivationOffload, HostBufferPool

    model = _build(0.0, True, host_budget_bytes=0)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    s = _offloader(model).stats(detail=True)
    assert s["d2h_bytes"] == s["host_pinned_bytes"] == s["host_allocations"] == 0
    assert s["kept_tensors"] == len(_saved_bytes_per_forward(4, 4, False))

    from python_api import runtime_of
    from python_api.host.offload import offload_stats

    plain = _build(0.0, False)
    plain(input_ids=ids, labels=ids).loss.backward()
    assert getattr(runtime_of(plain), "activation_offload", None) is None  # off: never created
    assert offload_stats(runtime_of(plain)) == {"d2h_bytes": 0, "h2d_bytes": 0, "host_pinned_bytes": 0}
    assert offload_stats(runtime_of(model)) == _offloader(model).stats()

    for bad in (1, MIN_HOST_BUFFER_BYTES - 1):
        # Refused at wrap time (finish_registration), before any forward.
        with pytest.raises(ValueError, match=r"host_budget_bytes=\d+ is smaller than one host buffer"):
            _build(0.0, True, host_budget_bytes=bad)
        with pytest.raises(ValueError, match="smaller than one host buffer"):
            HostBufferPool(bad, pin=False)

    class FakeRuntime:
        policy = ElasticPolicy(offload_activations=True, host_budget_bytes=MIN_HOST_BUFFER_BYTES)
        device = torch.device("cpu")

    assert ActivationOffload(FakeRuntime()).pool.budget_bytes == MIN_HOST_BUFFER_BYTES


# ------------------------------------------------------------------------------ lifetime


def test_no_leak_no_grad_forward_twice_failed_backward_retain_graph():
    """no_grad saves and copies nothing; a graph dropped without backward, a forward run twice
    before one backward and a backward that raises all give every buffer back to the pool; the
    next steps allocate nothing new; a second backward through a retained graph is refused."""
    model = _build(0.1, True)
    off = None
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    from python_api import runtime_of

    off = runtime_of(model).activation_offload
    assert off is not None and off.stats(detail=True)["d2h_bytes"] == 0 and off.pool.allocations == 0

    model(input_ids=ids, labels=ids).loss.backward()  # step 1: the pool fills
    allocations, held = off.pool.allocations, off.pool.held_bytes
    assert off.pool.in_use_bytes == 0 and allocations > 0

    loss = model(input_ids=ids, labels=ids).loss  # dropped without backward
    assert off.pool.in_use_bytes == held
    del loss
    assert off.pool.in_use_bytes == 0  # freed with the graph, by reference counting

    loss = model(input_ids=ids, labels=ids).loss
    loss = model(input_ids=ids, labels=ids).loss  # forward twice: the first graph dies here
    assert off.pool.in_use_bytes == held
    loss.backward()
    del loss
    assert off.pool.in_use_bytes == 0
    # Both graphs were alive during the second forward (the first is released only when `loss`
    # is rebound), so the pool holds two forwards' worth now: bounded (by the budget when one
    # is set), and recycled from here on.
    assert (off.pool.allocations, off.pool.held_bytes) == (2 * allocations, 2 * held)
    allocations, held = off.pool.allocations, off.pool.held_bytes

    class Boom(RuntimeError):
        pass

    def fail(grad):
        raise Boom("backward failed in the middle")

    def arm(module, args, out):  # layer 0's output fails its backward (returns None: output unchanged)
        (out[0] if isinstance(out, tuple) else out).register_hook(fail)

    handle = model.model.layers[0].register_forward_hook(arm)
    loss = model(input_ids=ids, labels=ids).loss
    try:
        loss.backward()
        raise AssertionError("the backward hook did not raise")
    except Boom:
        pass
    handle.remove()
    assert 0 < off.pool.in_use_bytes < held // 2  # layer 1 restored, layer 0 still waiting
    del loss
    gc.collect()  # the exception's traceback may have held the graph
    assert off.pool.in_use_bytes == 0

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True.* not supported"):
        loss.backward()
    del loss
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert off.pool.in_use_bytes == 0
    assert (off.pool.allocations, off.pool.held_bytes) == (allocations, held), "a new host buffer in steady state"


def test_copy_back_runs_one_layer_ahead(monkeypatch):
    """When the backward of the k-th offloading layer asks for its tensors, the copy-back of
    the (k-1)-th is issued right then (before the k-th layer's backward computes)."""
    from python_api import activation_offload as ao

    model = _build(0.0, True)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    events = []
    real_copy_back, real_restore = ao._Offloaded._copy_back, ao._Offloaded.restore
    order = {}

    def copy_back(self):
        events.append(("copy", order[id(self)]))
        return real_copy_back(self)

    def restore(self, saved):
        events.append(("restore", order[id(self)]))
        return real_restore(self, saved)

    real_offload = ao.ActivationOffload.offload

    def offload(self, tensors, activations):
        kept, h = real_offload(self, tensors, activations)
        order[id(h)] = len(order)
        return kept, h

    monkeypatch.setattr(ao._Offloaded, "_copy_back", copy_back)
    monkeypatch.setattr(ao._Offloaded, "restore", restore)
    monkeypatch.setattr(ao.ActivationOffload, "offload", offload)
    model(input_ids=ids, labels=ids).loss.backward()
    n = len(TARGETS) * LAYERS
    expected = [("restore", n - 1), ("copy", n - 1), ("copy", n - 2)]
    for k in range(n - 2, 0, -1):
        expected += [("restore", k), ("copy", k - 1)]
    expected += [("restore", 0)]
    assert events == expected, events


def test_host_buffer_pool():
    from python_api.host.offload import MIN_HOST_BUFFER_BYTES, HostBufferPool, size_class

    assert [size_class(n) for n in (0, 1, 512, 513, 4096, 4097)] == [512, 512, 512, 1024, 4096, 8192]
    pool = HostBufferPool(3 * 1024, pin=False)
    a, b = pool.acquire(600), pool.acquire(1000)
    assert a.numel() == b.numel() == 1024 and pool.held_bytes == pool.in_use_bytes == 2048
    assert pool.acquire(1500) is None  # 2048 more would pass the cap
    c = pool.acquire(MIN_HOST_BUFFER_BYTES)  # a new small class still fits: 2048 + 512
    pool.release(a)
    again = pool.acquire(700)
    assert again.data_ptr() == a.data_ptr() and pool.allocations == 3  # recycled, not allocated
    pool.release(again), pool.release(b), pool.release(c)
    assert pool.in_use_bytes == 0 and pool.held_bytes == 2560
    assert pool.trim() == 2560 and pool.held_bytes == 0
    unbounded = HostBufferPool(None, pin=False)
    assert unbounded.acquire(1 << 20) is not None


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cuda_offload_bit_identical_pinned_and_stream_ordered():
    """On CUDA: host buffers pinned, copies on the offloader's copy stream, gradients bit-
    identical to offload off over several steps, h2d == d2h, steady state."""
    from python_api import ElasticPolicy, LoRAConfig, convert_to_elastic, runtime_of

    def build(offload):
        m = tiny_llama().cuda()
        m = convert_to_elastic(m, LoRAConfig(r=R, alpha=8, dropout=0.1, target_modules=TARGETS),
                               ElasticPolicy(**CHUNKED, offload_activations=offload))
        gen = torch.Generator().manual_seed(7)
        for _, layer in lora_layers(m):
            with torch.no_grad():
                layer.lora_B.weight.copy_((torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1).cuda())
        return m.train()

    models = {flag: build(flag) for flag in (False, True)}
    allocations = None
    for step in range(3):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step)).cuda()
        res = {}
        for flag, m in models.items():
            torch.manual_seed(step)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            res[flag] = (loss.detach(), _grads(m))
            for p in m.parameters():
                p.grad = None
        assert torch.equal(res[False][0], res[True][0])
        assert all(torch.equal(a, b) for a, b in zip(res[False][1], res[True][1]))
        off = runtime_of(models[True]).activation_offload
        s = off.stats(detail=True)
        assert off.copy_stream is not None
        assert s["d2h_bytes"] == s["h2d_bytes"] > 0 and s["host_in_use_bytes"] == 0
        assert all(b.is_pinned() for bufs in off.pool._free.values() for b in bufs)
        allocations = s["host_allocations"] if allocations is None else allocations
        assert s["host_allocations"] == allocations
        off.reset_stats()
