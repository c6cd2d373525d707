"""Activation offload (python_api/host/offload.py, [Note: activation offload]).

Parity is bit for bit (fp32 and bf16 autocast on CPU) between the same model run with
`offload_activations` on and off, same ranks, same data, same RNG: offloading only copies
bytes, so not one bit may change. Traffic is checked against its analytic value (the bytes of
the activations every elastic LoRA layer saves), the budget against the pool's documented
greedy rule, steady state by counting host allocations, and lifetime by the bytes in use.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

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
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic

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
    from elastic_kernels.api.nn import lora_layers as layers

    return layers(model)


def _offloader(model):
    from elastic_kernels.api import runtime_of

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
    from elastic_kernels.api import no_sync

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
            # Host buffers held: one forward's worth, each activation in its size class (the
            # micro-batches run one after the other, so the second recycles the first's); none
            # with checkpointing, which offloads nothing.
            from elastic_kernels.api.host.offload import size_class

            held = 0 if ckpt else sum(size_class(b) for b in _saved_bytes_per_forward(2 if autocast else 4, 4, dropout > 0))
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
                assert s["host_pinned_bytes"] == held, (what, step, s, held)


# ------------------------------------------------------------------------------ budget


def _expected_kept(sizes: list[int], budget: int) -> list[bool]:
    """The pool's rule in the first step (all buffers busy until backward): in forward order a
    tensor is offloaded iff a new buffer of its class fits under the budget."""
    from elastic_kernels.api.host.offload import size_class

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
    from elastic_kernels.api import reset_stats, stats
    from elastic_kernels.api.nn import ElasticLoRAFunction

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
    from elastic_kernels.api.host.offload import size_class

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
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.host.offload import MIN_HOST_BUFFER_BYTES, ActivationOffload, HostBufferPool

    model = _build(0.0, True, host_budget_bytes=0)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    s = _offloader(model).stats(detail=True)
    assert s["d2h_bytes"] == s["host_pinned_bytes"] == s["host_allocations"] == 0
    assert s["kept_tensors"] == len(_saved_bytes_per_forward(4, 4, False))

    from elastic_kernels.api import runtime_of
    from elastic_kernels.api.host.offload import offload_stats

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
    from elastic_kernels.api import runtime_of

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
    from elastic_kernels.api.host import offload as ao

    model = _build(0.0, True)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    events = []
    real_copy_back, real_restore = ao._Offloaded._copy_back, ao._Offloaded.restore
    order = {}

    def copy_back(self):
        events.append(("copy", order[id(self)]))
        return real_copy_back(self)

    def restore(self, saved, **kwargs):
        events.append(("restore", order[id(self)]))
        return real_restore(self, saved, **kwargs)

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
    from elastic_kernels.api.host.offload import MIN_HOST_BUFFER_BYTES, HostBufferPool, size_class

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


def test_idle_buffers_include_those_given_back_but_not_filed():
    """What a step's backward gives back waits in the return queue until the next request;
    idle_buffers() is every buffer not in use, those included (the CPU peak measurement
    excludes them as host memory: python_api/planning/peaks.py, host_tier_storages)."""
    from elastic_kernels.api.host.offload import HostBufferPool

    pool = HostBufferPool(None, pin=False)
    a, b, c = pool.acquire(1000), pool.acquire(3000), pool.acquire(3000)
    pool.release(a), pool.release(b)  # c stays in use
    assert pool._returned and not any(pool._free.values())  # given back, not filed yet
    idle = {t.data_ptr() for t in pool.idle_buffers()}
    assert idle == {a.data_ptr(), b.data_ptr()} and c.data_ptr() not in idle
    assert pool.in_use_bytes == 4096 and pool.held_bytes == 1024 + 2 * 4096


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cuda_offload_bit_identical_pinned_and_stream_ordered():
    """On CUDA: host buffers pinned, copies on the offloader's copy stream, gradients bit-
    identical to offload off over several steps, h2d == d2h, steady state."""
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic, runtime_of

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


# ------------------------------------------------------------------------------ deadlock (issue 17)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A handle dies inside a cyclic garbage collection (a dead graph in a reference cycle, as after a
# caught exception in a step): its __del__ returns its buffers to the pool. The collection is
# forced at the allocation the pool makes for a new buffer, and (second part) at every container
# allocation (gc threshold 1) while buffers are acquired and returned; a __del__ that takes a
# lock the allocating code holds hangs this process.
DEADLOCK_CHILD = textwrap.dedent(
    """
    import gc, sys, torch
    from elastic_kernels.api.config import ElasticPolicy
    from elastic_kernels.api.host.offload import ActivationOffload

    class FakeRuntime:
        policy = ElasticPolicy(offload_activations=True)
        device = torch.device("cpu")

    off = ActivationOffload(FakeRuntime())

    def cyclic_handle(n):
        kept, handle = off.offload((torch.ones(n),), (0,))
        assert handle is not None and kept == (None,)
        box = [handle]
        box.append(box)  # unreachable only through the cycle collector from here on

    gc.disable()
    cyclic_handle(64)
    in_use = off.pool.in_use_bytes
    assert in_use > 0
    real_empty = torch.empty

    def empty_collecting(*args, **kwargs):  # a collection at the pool's allocation
        gc.collect()
        return real_empty(*args, **kwargs)

    torch.empty = empty_collecting
    buf = off.pool.acquire(1 << 16)  # a size class the pool has not allocated yet
    torch.empty = real_empty
    assert buf is not None and buf.numel() == 1 << 16
    assert off.pool.in_use_bytes == 1 << 16, off.pool.in_use_bytes  # the dead handle's buffer is back
    off.pool.release(buf)
    print("part 1 ok", flush=True)

    gc.enable()
    gc.set_threshold(1, 1, 1)  # a collection at (almost) every container allocation
    for i in range(300):
        cyclic_handle(16 + i % 50)
        b = off.pool.acquire(1024 + 4096 * (i % 7))
        off.pool.release(b)
        off.trim() if i % 50 == 0 else None
    gc.set_threshold(700, 10, 10)
    gc.collect()
    assert off.pool.in_use_bytes == 0, off.pool.in_use_bytes
    print("part 2 ok", flush=True)
    """
)


def test_handle_dying_in_a_gc_inside_the_pool_lock_does_not_deadlock(tmp_path):
    """Defect 1 of issue 17: nothing that runs from `_Offloaded.__del__` may take a lock that
    allocating code holds. Run in a child with a bound: a deadlock is a timeout, not a hung suite."""
    script = tmp_path / "child.py"
    script.write_text(DEADLOCK_CHILD)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the child hung (deadlock): stdout so far {exc.stdout!r}") from None
    assert out.returncode == 0, out.stdout + out.stderr
    assert "part 1 ok" in out.stdout and "part 2 ok" in out.stdout, out.stdout


# ------------------------------------------------------------------------------ in-place check (issue 17)


def _inplace_worker(offload: bool, variant: str):
    """Forward a tiny model whose first LoRA layer's input is changed in place after that
    layer's forward; returns the backward's error text (None when it ran)."""
    model = _build(0.0, offload)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    q_proj = model.model.layers[0].self_attn.q_proj

    def change_input(module, args, out):
        x = args[0]
        if variant == "mul_":
            x.mul_(2.0)  # the layer's input, changed after the layer ran
        else:
            torch.nn.functional.dropout(x, p=0.5, training=True, inplace=True)

    q_proj.register_forward_hook(change_input)
    loss = model(input_ids=ids, labels=ids).loss
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("variant", ["mul_", "dropout_inplace"])
def test_inplace_change_of_an_offloaded_input_is_refused_like_autograd(variant):
    """Defect 4 of issue 17: an in-place change of a LoRA layer's input after its forward is
    refused by autograd without offload; with offload the same error (autograd's wording) is
    raised when the offloaded copy is restored, instead of silently using the old values."""
    plain = _inplace_worker(False, variant)
    assert plain is not None and "modified by an inplace operation" in plain, plain
    offloaded = _inplace_worker(True, variant)
    assert offloaded is not None, "offload used an activation that was changed in place after it was saved"
    assert offloaded.startswith("one of the variables needed for gradient computation has been modified by an "
                                "inplace operation: [torch.FloatTensor ["), offloaded
    assert "is at version 1; expected version 0 instead" in offloaded, offloaded


# ------------------------------------------------------------------------------ memory back (issue 17)

TRIM_CHILD = textwrap.dedent(
    """
    import gc, torch
    from elastic_kernels.api.host.offload import HostBufferPool

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    pool = HostBufferPool(None, pin=False)
    n, size = 64, 1 << 20
    for round in range(2):
        gc.collect()
        r0 = rss()
        bufs = [pool.acquire(size) for _ in range(n)]
        for b in bufs:
            b.fill_(1)  # touched: resident
        grown = rss() - r0
        for b in bufs:
            pool.release(b)
        del bufs, b
        freed = pool.trim()
        print(round, grown, rss() - r0, freed, pool.held_bytes, flush=True)
    """
)


def test_trim_returns_host_memory_to_the_os(tmp_path):
    """Issue 17, item 9: `trim()` must give the freed buffers' memory back to the operating
    system (measured as the resident set), not only drop them into the C library's heap.
    In a child process, so the heap state of the test session does not matter."""
    script = tmp_path / "child.py"
    script.write_text(TRIM_CHILD)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    mib = 1 << 20
    rows = [list(map(int, line.split())) for line in out.stdout.strip().splitlines()]
    assert len(rows) == 2, out.stdout
    for rnd, grown, left, freed, held in rows:
        assert freed == 64 * mib and held == 0, rows
        assert grown >= 56 * mib, f"round {rnd}: touching 64 MiB of buffers grew the RSS by {grown / mib:.1f} MiB only"
        # Allowance: 8 MiB for the interpreter's own pages touched meanwhile (the list, ints).
        assert left <= 8 * mib, f"round {rnd}: {left / mib:.1f} MiB of the 64 MiB trimmed are still resident"


def test_switching_offload_off_frees_the_host_buffers():
    """Issue 17, item 9: a re-plan that turns offload off (`set_offload_activations(False)`)
    frees the pool's buffers at once, and the buffers a live graph still holds when they come
    back; switching it on again recycles as before."""
    from elastic_kernels.api import runtime_of

    model = _build(0.0, True)
    rt = runtime_of(model)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    off = rt.activation_offload
    held = off.pool.held_bytes
    assert held > 0 and off.pool.in_use_bytes == 0
    rt.set_offload_activations(False)
    assert off.pool.held_bytes == 0, "switching offload off kept the host buffers"

    rt.set_offload_activations(True)
    loss = model(input_ids=ids, labels=ids).loss  # buffers in use by this graph
    assert off.pool.in_use_bytes == held
    rt.set_offload_activations(False)  # while the graph holds them
    assert off.pool.held_bytes == held  # in use: not freed under the graph
    loss.backward()
    del loss
    assert off.pool.held_bytes == 0 and off.pool.in_use_bytes == 0, "returned buffers were kept after offload was off"
    model(input_ids=ids, labels=ids).loss.backward()  # off: nothing offloaded, nothing allocated
    assert off.pool.held_bytes == 0
    rt.set_offload_activations(True)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert off.pool.held_bytes == held and off.pool.in_use_bytes == 0


# ------------------------------------------------------------------------------ GPU: ordering under delay (issue 17)

GPU_SLEEP = 20_000_000  # cycles: ~10 ms at 2 GHz, far longer than one 32 MiB copy (< 1 ms)


class _Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _gpu_stack(offload: bool, width: int, depth: int, dropout: float = 0.1):
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic

    torch.manual_seed(0)
    m = _Stack(width, depth).cuda()
    m.requires_grad_(False)
    m = convert_to_elastic(m, LoRAConfig(r=8, alpha=16, dropout=dropout, target_modules=r"layers\.\d+"),
                           ElasticPolicy(offload_activations=offload))
    gen = torch.Generator().manual_seed(7)
    for _, layer in lora_layers(m):
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen).cuda() * 0.1)
    return m.train()


# Each variant delays one side so that one ordering matters (see the test's docstring):
#   input_sleeps: sleeps on the compute stream before each step's input is written
#   d2h_sleeps: sleeps on the copy stream, after it caught up with compute, before each offload
#   h2d_sleeps: sleeps on the copy stream before each copy-back
#   backward_sleeps: sleeps on the compute stream before each layer's backward
DELAYS = {
    "d2h_waits_for_compute": dict(input_sleeps=5, d2h_sleeps=0, h2d_sleeps=0, backward_sleeps=0),
    "d2h_source_not_reused": dict(input_sleeps=0, d2h_sleeps=1, h2d_sleeps=0, backward_sleeps=0),
    "h2d_waited_for": dict(input_sleeps=0, d2h_sleeps=0, h2d_sleeps=1, backward_sleeps=0),
    "h2d_result_not_reused": dict(input_sleeps=0, d2h_sleeps=0, h2d_sleeps=0, backward_sleeps=1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(DELAYS))
def test_cuda_offload_ordered_under_delayed_streams(monkeypatch, variant):
    """Every ordering the CUDA offload relies on, each made to matter by a delay (issue 17):
    "d2h_waits_for_compute": each step's input is written behind a long sleep on the compute
    stream (a D2H that does not wait for compute copies it unwritten); "d2h_source_not_reused":
    every D2H waits behind a sleep on the copy stream while, after each layer's forward, the
    freed activations' memory is claimed and overwritten at once on the compute stream (without
    `record_stream` on the copy stream the allocator hands it out under the late D2H);
    "h2d_waited_for": every copy-back waits behind a sleep on the copy stream (without
    `wait_event` the backward reads the restored tensor before it arrives);
    "h2d_result_not_reused": each layer's backward waits behind a sleep on the compute stream (a
    restored tensor freed without `record_stream` on compute is reused by the next copy-back
    while its backward is still to read it). Losses and adapter gradients must equal offload
    off bit for bit, under the same delays."""
    from elastic_kernels.api import runtime_of
    from elastic_kernels.api.host import offload as ao

    delays = DELAYS[variant]
    width, depth, tokens = 2048, 4, 4096  # each activation 32 MiB
    real_offload, real_copy_back = ao.ActivationOffload.offload, ao._Offloaded._copy_back

    def delayed_offload(self, tensors, activations):
        if delays["d2h_sleeps"]:
            # Behind the compute stream first, so that the sleep delays the copies *after* the
            # point where the layer drops its tensors (this variant tests their record_stream;
            # "d2h_waits_for_compute" tests the offloader's own wait, which this would mask).
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(delays["d2h_sleeps"] * GPU_SLEEP)
        return real_offload(self, tensors, activations)

    def delayed_copy_back(self):
        with torch.cuda.stream(self._owner.copy_stream):
            torch.cuda._sleep(delays["h2d_sleeps"] * GPU_SLEEP)
        return real_copy_back(self)

    monkeypatch.setattr(ao.ActivationOffload, "offload", delayed_offload)
    monkeypatch.setattr(ao._Offloaded, "_copy_back", delayed_copy_back)

    def run(model):
        junk = []

        def claim_freed_memory(module, args, out):  # the freed activations' blocks, overwritten now
            junk.append(torch.full((tokens, width), 1e6, device="cuda"))
            junk.append(torch.full((tokens, width), -1e6, device="cuda"))

        def delay_backward(grad):
            torch.cuda._sleep(delays["backward_sleeps"] * GPU_SLEEP)
            return grad

        layers = [layer for _, layer in lora_layers(model)]
        assert len(layers) == depth
        hooks = [layer.register_forward_hook(claim_freed_memory) for layer in layers]
        hooks += [layer.register_forward_hook(lambda m, a, out: out.register_hook(delay_backward) and None)
                  for layer in layers]
        out = []
        for step in range(3):
            base = torch.randn(tokens, width, generator=torch.Generator().manual_seed(step)).cuda()
            torch.cuda.synchronize()
            torch.cuda._sleep(delays["input_sleeps"] * GPU_SLEEP)
            x = base * 0.5  # written only after the sleep
            torch.manual_seed(100 + step)  # the dropout masks
            loss = model(x).square().mean()
            junk.clear()
            loss.backward()
            out.append((loss.detach().clone(), _grads(model)))
            for p in model.parameters():
                p.grad = None
        for h in hooks:
            h.remove()
        torch.cuda.synchronize()
        return out

    plain = run(_gpu_stack(False, width, depth))
    model = _gpu_stack(True, width, depth)
    offloaded = run(model)
    s = runtime_of(model).activation_offload.stats(detail=True)
    assert s["d2h_bytes"] > 0 and s["d2h_bytes"] == s["h2d_bytes"] and s["host_in_use_bytes"] == 0, s
    for step, ((l0, g0), (l1, g1)) in enumerate(zip(plain, offloaded)):
        assert torch.equal(l0, l1), f"{variant} step {step}: loss {l0.item()} vs {l1.item()} with offload"
        assert all(torch.equal(a, b) for a, b in zip(g0, g1)), f"{variant} step {step}: adapter gradients differ"


@pytest.mark.gpu
def test_cuda_inplace_change_after_offload_is_refused():
    """Defect 4 on CUDA: the D2H copy of an input changed in place after the layer's forward
    races with the in-place kernel; restore refuses it with autograd's error instead."""
    model = _gpu_stack(True, 256, 2, dropout=0.0)  # no dropout: the layer saves its input itself
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    h = x * 1.0
    first = next(layer for _, layer in lora_layers(model))

    def change_input(module, args, out):
        args[0].mul_(2.0)

    first.register_forward_hook(change_input)
    loss = model(h).sum()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch\.cuda\.FloatTensor \[64, 256\]\] "
                                           r"is at version 1; expected version 0"):
        loss.backward()
