"""Stream ordering of the runtime's fills (issue 17): per-chunk events of host copies, and the
streams recorded on pages freed on the error path ([Note: pages freed on the error path] in
python_api/runtime/_gathers.py, [Note: host copies are stream ordered] in
python_api/host/sources.py).

On CPU the CUDA calls are replaced by fakes that log what would be enqueued (which stream
waits for which event, which event is recorded after which copy, which streams a page is
recorded on before it is freed): the bookkeeping is checked here, the ordering it buys on a
real device by the `gpu` tests at the end, which delay the side streams with
`torch.cuda._sleep` so that a missing wait or record shows as wrong data.
"""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.needs_ext]

FP32 = 4


class FakeStream:
    """Stands for a torch.cuda.Stream: logs the waits enqueued on it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event.id))

    def __repr__(self):
        return f"FakeStream({self.name})"


def fake_cuda(log: list, on_record=None):
    """Patches of torch.cuda's stream, event and current-stream calls; returns (patches, compute)."""
    compute = FakeStream("compute", log)
    ids = itertools.count()

    class FakeEvent:
        def __init__(self, *args, **kwargs):
            self.id = next(ids)

        def record(self, stream=None):
            log.append((stream.name, "record", self.id))
            if on_record is not None:
                on_record(self)

    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda device=None: compute))
    patches.enter_context(mock.patch.object(torch.cuda, "stream", lambda s: contextlib.nullcontext()))
    patches.enter_context(mock.patch.object(torch.cuda, "Event", FakeEvent))
    return patches, compute


def test_host_copy_work_has_one_event_per_chunk():
    """Each chunk's event is recorded right after its own copy (the later chunks not yet
    copied), and waiting for chunk i waits for event i only; waiting for the whole work waits
    for the last event."""
    from elastic_kernels.api.host.sources import HostCopyWork

    n = 5
    srcs = [torch.full((3, 4), float(i + 1)) for i in range(n)]
    dsts = [torch.zeros(3, 4) for _ in range(n)]
    log, snapshots = [], []

    def on_record(event):
        snapshots.append([torch.equal(s, d) for s, d in zip(srcs, dsts)])

    patches, compute = fake_cuda(log, on_record)
    copy = FakeStream("copy", log)
    with patches:
        work = HostCopyWork(list(zip(srcs, dsts)), copy, torch.device("cpu"))
        assert log[0] == ("copy", "wait_stream", "compute")  # the copies wait for compute first
        assert [e for e in log[1:]] == [("copy", "record", i) for i in range(n)]
        assert snapshots == [[j <= i for j in range(n)] for i in range(n)], snapshots
        log.clear()
        work.part(2).wait("chunk 2")
        work.part(2).wait("chunk 2")  # once
        assert log == [("compute", "wait_event", 2)]
        assert not work.part(0).done and not work.done
        log.clear()
        work.wait("all")
        assert log == [("compute", "wait_event", n - 1)] and all(p.done for p in work.parts)


class SpyPool:
    """Forwards to a PagePool and logs record_stream and free (a CPU pool ignores streams)."""

    def __init__(self, pool, log: list):
        self._pool, self._log = pool, log

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def record_stream(self, key, stream):
        self._log.append(("record_stream", key, stream.name))

    def free(self, key):
        self._log.append(("free", key))
        self._pool.free(key)


def _fill_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, ElasticRuntime
    from elastic_kernels.api.runtime import _gathers
    from elastic_kernels.api.runtime._gathers import Resident

    torch.manual_seed(0)
    weights = [torch.randn(40, 16), torch.randn(24, 16)]
    policy = ElasticPolicy(chunk_bytes=8 * 16 * FP32, host_fraction=0.5, keep_ratio=0.0, persist_ratio=0.0,
                           pool_budget_bytes=0)
    rt = ElasticRuntime(policy, force_pool=True)
    ets = [rt.register(w, f"w{i}") for i, w in enumerate(weights)]
    rt.finish_registration()
    rt._ensure_pool()
    log: list = []
    rt.pool = SpyPool(rt.pool, log)
    patches, compute = fake_cuda(log)
    out = {}
    with patches:
        rt.comm_stream, rt.copy_stream = FakeStream("comm", log), FakeStream("copy", log)

        # 1. The error path: the gathers of the second weight cannot be issued after the host
        # copies of both were enqueued.
        def no_gather(*args, **kwargs):
            raise RuntimeError("injected: the gather could not be issued")

        with mock.patch.object(_gathers, "GatherWork", no_gather):
            with pytest.raises(RuntimeError, match="injected"):
                rt._start_uses(ets)
        host = {et.keys[c] for et in ets for c in range(et.num_chunks) if et.from_host[c]}
        peer = {et.keys[c] for et in ets for c in range(et.num_chunks) if not et.from_host[c]}
        freed = [e[1] for e in log if e[0] == "free"]
        recorded = {}
        for e in log:
            if e[0] == "record_stream":
                recorded.setdefault(e[1], set()).add(e[2])
            elif e[0] == "free":
                recorded.setdefault(e[1], set()).add("<freed>")
        out["error_path"] = dict(host=sorted(host), peer=sorted(peer), freed=sorted(freed),
                                 recorded={k: sorted(v) for k, v in recorded.items()},
                                 left=[k for k in host | peer if rt.pool.contains(k)])

        # 2. The normal path: each host chunk waits for its own copy's event.
        log.clear()
        (use,) = rt._start_uses([ets[0]])
        copy_events = [e[2] for e in log if e[:2] == ("copy", "record")]
        log.clear()
        order = []
        Resident(use).execute(lambda c, chunk: order.append(
            (c, [e[2] for e in log if e[:2] == ("compute", "wait_event")][-1:])))
        rt._end_use(use, keep=0)
        out["normal"] = dict(from_host=ets[0].from_host, copy_events=copy_events, waits=order,
                             recorded=[e for e in log if e[0] == "record_stream"],
                             same=all(torch.equal(ch, weights[0][r0:r1]) for ch, (r0, r1) in
                                      zip(use.chunks, (ets[0].layout.chunk_rows(c) for c in range(ets[0].num_chunks)))))
    return out


@pytest.mark.distributed
def test_error_path_records_the_filling_streams_and_host_chunks_wait_alone():
    """Defect 5 of issue 17: pages freed because a use failed to start are recorded on the copy
    stream (host copies) and the communication stream (gathers) before they are freed, not on
    the compute stream alone. And each host chunk's use waits for its own copy's event
    (within-use pipelining for host chunks, issue 17 item 9)."""
    (out,) = run_distributed(_fill_worker, 1, timeout=120)
    err = out["error_path"]
    assert err["host"] and err["peer"]
    assert err["left"] == [], "pages of the failed uses were left in the pool"
    for key in err["host"] + err["peer"]:
        assert key in err["freed"], (key, err)
    for key in err["host"]:
        assert "copy" in err["recorded"][key], f"host page {key} freed with streams {err['recorded'][key]} only"
    for key in err["peer"]:
        assert "comm" in err["recorded"][key], f"peer page {key} freed with streams {err['recorded'][key]} only"

    normal = out["normal"]
    assert normal["same"]
    host_chunks = [c for c, h in enumerate(normal["from_host"]) if h]
    assert len(normal["copy_events"]) == len(host_chunks) >= 2, normal
    for (c, waited), h in zip(normal["waits"], normal["from_host"]):
        if h:
            assert waited == [normal["copy_events"][host_chunks.index(c)]], (c, waited, normal)
    # Filled and waited for: ordered through the compute stream alone.
    assert {e[2] for e in normal["recorded"]} == {"compute"}, normal["recorded"]


# ------------------------------------------------------------------------------ GPU

SLEEP_CYCLES = 50_000_000  # ~25-40 ms on a recent GPU: far longer than the work it delays


@pytest.mark.gpu
def test_cuda_error_path_late_copy_does_not_overwrite_a_reused_page():
    """Defect 5 on a device: the host copies of a use are delayed on the copy stream, the use
    then fails to start and frees its pages; the next gathers (communication stream) get pages
    at once. With the copy stream recorded on the freed pages, the late copies cannot land in
    pages handed out again: the next weight's chunks hold its own values."""
    (out,) = run_distributed(_cuda_error_path_worker, 1, timeout=300)
    assert out["ok"], out


def _cuda_error_path_worker(rank, world_size):
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy, ElasticRuntime

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group([0], backend="nccl")
    rows, cols = 1024, 1024  # 4 MiB chunks: copies long enough to race
    torch.manual_seed(0)
    a = torch.randn(8 * rows, cols, device=device)
    b = torch.randn(8 * rows, cols, device=device) + 100.0  # other values: a late copy of `a` shows
    policy = ElasticPolicy(chunk_bytes=rows * cols * FP32, host_fraction=1.0, keep_ratio=0.0, persist_ratio=0.0,
                           pool_budget_bytes=0, prefetch_depth=0)
    rt = ElasticRuntime(policy, group=group, device=device, force_pool=True)
    et_a, et_b = rt.register(a, "a"), rt.register(b, "b")
    rt.finish_registration()
    rt._ensure_pool()
    # Only host chunks for `a`, only peer chunks for `b`, in a pool the size of one weight.
    et_b.from_host = [False] * et_b.num_chunks
    rt.pool.set_budget(et_a.num_chunks * rt.page_bytes())

    def fail_after_copies(runs):
        raise RuntimeError("injected after the host copies were issued")

    torch.cuda.synchronize()
    with torch.cuda.stream(rt.copy_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copies of `a`, enqueued behind this, run late
    with mock.patch.object(rt, "_issue_gathers", fail_after_copies):
        try:
            rt._start_uses([et_a, et_b])
        except RuntimeError as exc:
            assert "injected" in str(exc)
        else:
            raise AssertionError("the injected failure did not happen")
    assert not any(rt.pool.contains(k) for k in et_a.keys)
    (use,) = rt._start_uses([et_b])  # its gathers get the pages `a` just gave back
    chunks = [use.works[c].wait("b") or use.chunks[c] for c in range(et_b.num_chunks)]
    got = torch.cat([ch.reshape(-1, cols) for ch in chunks])
    torch.cuda.synchronize()
    ok = torch.equal(got, b)
    rt._end_use(use, keep=0)
    return {"ok": ok}


@pytest.mark.gpu
def test_cuda_host_chunks_pipeline_within_a_use():
    """Item 9 on a device: with one event per host chunk, computing on the first chunk of a use
    starts while the later chunks are still copying (its compute-stream event completes well
    before the copy stream's last event)."""
    from elastic_kernels.api.host.sources import HostCopyWork

    device = torch.device("cuda", 0)
    n, numel = 8, 16 << 20  # 8 chunks of 64 MiB, pinned host memory
    srcs = [torch.full((numel,), float(i), pin_memory=True) for i in range(n)]
    dsts = [torch.empty(numel, device=device) for _ in range(n)]
    copy = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    work = HostCopyWork(list(zip(srcs, dsts)), copy, device)
    work.part(0).wait("chunk 0")
    first = torch.cuda.Event(enable_timing=True)
    first.record()  # compute stream: ready to compute on chunk 0
    last = torch.cuda.Event(enable_timing=True)
    last.record(copy)  # after the last copy
    work.wait("all")
    torch.cuda.synchronize()
    assert all(bool((d == i).all()) for i, d in enumerate(dsts))
    lead_ms = first.elapsed_time(last)  # > 0: chunk 0 was ready before the last copy ended
    # 7 of 8 chunks are still to copy when chunk 0 is ready: at PCIe/NVLink-C2C rates of at
    # most ~50 GB/s that is >= 9 ms; one event for the whole use would make lead_ms <= 0.
    assert lead_ms > 2.0, f"chunk 0 was ready only {lead_ms:.2f} ms before the last host chunk arrived"


# The host tier inside the runtime on a device: copy stream, communication stream and PagePool
# reuse (budget 0: pages change hands at every layer), each side delayed in turn.
RUNTIME_DELAYS = {
    "late_fills": dict(fill_sleeps=1, compute_sleeps=0),  # compute must wait for each chunk's fill
    "late_compute": dict(fill_sleeps=0, compute_sleeps=1),  # a reused page is refilled only after its readers
}


def _cuda_host_tier_worker(rank, world_size, delays):
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    from elastic_kernels.api import ElasticLinear, ElasticPolicy, ElasticRuntime
    from elastic_kernels.api.distributed import collectives
    from elastic_kernels.api.host import sources
    from elastic_kernels.api.runtime import _gathers

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group([0], backend="nccl")
    dims = (1024, 2048, 1024, 2048, 1024)
    real_copy, real_gather = sources.HostCopyWork, collectives.GatherWork

    def late(stream, sleeps):
        if sleeps:
            stream.wait_stream(torch.cuda.current_stream())  # after its readers: the sleep delays the fill itself
            with torch.cuda.stream(stream):
                torch.cuda._sleep(sleeps * SLEEP_CYCLES)

    def host_copy(pairs, copy_stream=None, device=None):
        late(copy_stream, delays["fill_sleeps"])
        return real_copy(pairs, copy_stream, device)

    def gather(runs, group, world_size, comm_stream=None, *args, **kwargs):
        late(comm_stream, delays["fill_sleeps"])
        return real_gather(runs, group, world_size, comm_stream, *args, **kwargs)

    def run(delayed: bool):
        torch.manual_seed(0)
        linears = [nn.Linear(a, b, device=device).requires_grad_(False) for a, b in zip(dims[:-1], dims[1:])]
        policy = ElasticPolicy(chunk_bytes=128 * max(dims) * FP32, host_fraction=0.5, keep_ratio=0.0,
                               persist_ratio=0.0, pool_budget_bytes=0, prefetch_depth=1)
        rt = ElasticRuntime(policy, group=group, device=device, force_pool=True)
        layers = [ElasticLinear.from_linear(lin, rt, f"l{i}") for i, lin in enumerate(linears)]
        rt.finish_registration()
        outs = []
        with mock.patch.object(_gathers, "HostCopyWork", host_copy if delayed else real_copy), \
                mock.patch.object(_gathers, "GatherWork", gather if delayed else real_gather):
            for it in range(3):
                x = torch.randn(512, dims[0], generator=torch.Generator().manual_seed(it)).to(device)
                x.requires_grad_(True)
                y, ref = x, x.detach()
                for layer, lin in zip(layers, linears):
                    if delayed and delays["compute_sleeps"]:
                        torch.cuda._sleep(delays["compute_sleeps"] * SLEEP_CYCLES)
                    y = torch.tanh(layer(y))
                    ref = torch.tanh(F.linear(ref, lin.weight, lin.bias))
                y.square().sum().backward()
                outs.append((y.detach().clone(), x.grad.clone(), float((y.detach() - ref).abs().max())))
        torch.cuda.synchronize()
        s = rt.stats()
        return outs, s["h2d_bytes"], s["allgather_calls"]

    plain, h2d, gathers = run(False)
    delayed, _, _ = run(True)
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, delayed))
    return dict(same=same, err=max(o[2] for o in plain + delayed), h2d=h2d, gathers=gathers)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(RUNTIME_DELAYS))
def test_cuda_host_tier_in_the_runtime_under_delays(variant):
    """Issue 17: the runtime's host tier on a device, half the chunks from the host store (copy
    stream), half gathered (communication stream), through a PagePool of budget 0: with every
    fill delayed ("late_fills": each chunk's compute must wait for its own fill event) or every
    layer's compute delayed ("late_compute": a page handed to the next fill must wait for the
    kernels that read it), outputs and input gradients equal the undelayed run bit for bit and
    plain F.linear within fp32 rounding."""
    (out,) = run_distributed(_cuda_host_tier_worker, 1, RUNTIME_DELAYS[variant], timeout=400)
    assert out["h2d"] > 0 and out["gathers"] > 0, out  # both sources were used
    assert out["same"], f"{variant}: the delays changed a result"
    # tanh outputs in [-1, 1], dot products of 2048 fp32 terms: a few ulp of 1 accumulate.
    assert out["err"] < 1e-4, out
