"""The host store (csrc/host/, elastic_kernels/host_store.py) and its node handshake
(python_api/host/store.py): shared contents, one copy per node (measured), no leaks whatever
way a rank ends, clear errors on bad input.

Both implementations run the single-process tests: the compiled one ("cpp", whenever the
extension is built; skipped only under ELASTIC_SKIP_EXT=1) and the pure-Python fallback
("python", always). The distributed tests use the default ("auto": the compiled one when it is
loaded), plus one run with each forced. Leak tests start plain subprocesses (not
tests/_dist.py) so that a rank can be sent SIGTERM or SIGKILL at a known point.
"""

from __future__ import annotations

import errno
import functools
import gc
import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from elastic_kernels import HostStore, HostStoreError
from elastic_kernels.api.host.store import HostStoreSetupError, local_share, node_host_store
from tests import _skips
from tests._dist import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
PAGE = 4096


@pytest.fixture(params=["cpp", "python"])
def impl(request):
    if request.param == "cpp":
        _skips.require_ext()
    return request.param


def pattern(start: int, stop: int, salt: int = 0) -> torch.Tensor:
    """The bytes a fill writes at [start, stop): position-dependent, so a share written at the
    wrong offset or a segment that is not shared shows."""
    i = torch.arange(start, stop, dtype=torch.int64)
    return ((i * 7 + i // 4093 + salt) % 251).to(torch.uint8)


def mapped_anywhere(name: str) -> list[str]:
    """Processes on this machine that map the segment `name` or hold an fd to it."""
    found = []
    for maps in glob.glob("/proc/[0-9]*/maps"):
        pid = maps.split("/")[2]
        try:
            with open(maps) as f:
                if name in f.read():
                    found.append(f"{pid} maps it")
        except OSError:
            continue
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                if name in os.readlink(fd):
                    found.append(f"{pid} holds {fd}")
            except OSError:
                continue
    return found


def shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


def pss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise AssertionError("no Pss line in /proc/self/smaps_rollup")


# --------------------------------------------------------------------------------------------
# One process: the mechanism.
# --------------------------------------------------------------------------------------------


def test_create_attach_share_memory(impl):
    n = 3 * PAGE + 5
    with HostStore.create(n, impl=impl) as s:
        assert s.impl == impl and s.creator and s.fd_open and s.nbytes == n and s.kind == "memfd"
        kind, pid, fd, ino, name = s.handle.split(":")
        assert kind == "memfd" and int(pid) == os.getpid() and name.startswith("elastic-hs-")
        t = s.tensor()
        assert t.dtype == torch.uint8 and t.shape == (n,) and t.device.type == "cpu"
        assert s.tensor() is t and int(t.sum()) == 0  # created zeroed
        t.copy_(pattern(0, n))
        with HostStore.attach(s.handle, n, impl=impl) as a:
            assert not a.creator and not a.fd_open and a.handle == s.handle
            assert a.data_ptr != s.data_ptr  # a second mapping of the same memory
            assert torch.equal(a.tensor(), pattern(0, n))
            a.tensor()[n - 1] = 200  # writes go both ways
            assert int(t[n - 1]) == 200
        s.close_fd()
        assert not s.fd_open
        s.close_fd()  # idempotent
        assert int(t[0]) == int(pattern(0, 1)[0])  # the creator's mapping outlives its fd
        assert name in open("/proc/self/maps").read()
    assert s.closed


def test_implementations_attach_to_each_other():
    _skips.require_ext()
    for maker, user in (("cpp", "python"), ("python", "cpp")):
        with HostStore.create(PAGE, impl=maker) as s, HostStore.attach(s.handle, PAGE, impl=user) as a:
            s.tensor().fill_(42)
            assert bool((a.tensor() == 42).all())


@pytest.mark.parametrize("kind", ["memfd", "shm"])
def test_close_unmaps_and_leaves_nothing(impl, kind):
    before = set(os.listdir("/dev/shm"))
    s = HostStore.create(2 * MIB, kind=kind, impl=impl)
    name = s.handle.rsplit(":", 1)[1]
    if kind == "shm":
        assert f"{name}" in os.listdir("/dev/shm")  # linked only until close_fd
    a = HostStore.attach(s.handle, 2 * MIB, impl=impl)
    s.close_fd()
    assert set(os.listdir("/dev/shm")) == before  # no name from here on, for either kind
    view = a.view(PAGE, torch.float32, (4, 8))
    view.fill_(1.5)
    s.close()
    a.close()
    gc.collect()
    assert float(view.sum()) == 48.0  # a view keeps its mapping alive after close()
    with pytest.raises(RuntimeError, match="closed"):
        a.tensor()
    del view
    gc.collect()
    assert mapped_anywhere(name) == []


def test_view_checks(impl):
    with HostStore.create(PAGE, impl=impl) as s:
        v = s.view(8, torch.float64, (2, 3))
        assert v.shape == (2, 3) and v.data_ptr() == s.data_ptr + 8
        assert s.view(PAGE - 4, torch.int32, 1).numel() == 1
        with pytest.raises(ValueError, match="multiple"):
            s.view(2, torch.float32, 1)
        with pytest.raises(ValueError, match="outside"):
            s.view(PAGE - 4, torch.float32, 2)
        with pytest.raises(ValueError, match="non-negative"):
            s.view(-8, torch.float32, 1)
        with pytest.raises(TypeError):
            s.view(0, "float32", 1)


def test_pin_without_a_gpu_is_a_no_op(impl):
    if _skips.gpu_present():
        pytest.skip("a GPU is visible: test_pin_on_cuda covers pinning")
    with HostStore.create(PAGE, impl=impl) as s:
        assert s.pin() is False and not s.pinned and s.pinned_bytes == 0
        assert HostStore.can_pin(impl) is False
        s.unpin()  # a no-op when not pinned


@pytest.mark.gpu
def test_pin_on_cuda():
    _skips.require_cuda_ext()
    n = 8 * MIB
    with HostStore.create(n, impl="cpp") as s:
        s.tensor().copy_(pattern(0, n))
        assert not s.tensor().is_pinned()
        assert s.pin("cuda") is True and s.pinned and s.pinned_bytes == n
        assert s.pin("cuda") is True  # idempotent
        assert s.tensor().is_pinned()  # cudaHostRegister'ed: the driver sees page-locked memory
        with HostStore.attach(s.handle, n, impl="cpp") as a:  # each process / mapping pins its own
            assert a.pin("cuda") and a.tensor().is_pinned()
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(copy_stream):
            dev.copy_(s.tensor(), non_blocking=True)
        copy_stream.synchronize()
        assert torch.equal(dev.cpu(), pattern(0, n))
        s.unpin()
        assert not s.pinned and s.pinned_bytes == 0 and not s.tensor().is_pinned()
        s.pin("cuda")  # the destructor unpins before munmap
    with node_host_store(n, device="cuda", fill=lambda st, lr, lw: st.tensor().fill_(5)) as st:
        assert st.pinned and st.pinned_bytes == n and st.tensor().is_pinned()


# ---- bad input ----


def test_bad_sizes_and_handles(impl):
    for bad in (0, -1, -PAGE):
        with pytest.raises(ValueError, match="positive"):
            HostStore.create(bad, impl=impl)
    with pytest.raises(TypeError):
        HostStore.create(1.5, impl=impl)
    with pytest.raises(TypeError):
        HostStore.create(True, impl=impl)
    with pytest.raises(ValueError, match="kind"):
        HostStore.create(PAGE, kind="file", impl=impl)
    for handle in ("", "memfd", "memfd:1:2:3", "nfs:1:2:3:elastic-hs-x", "memfd:x:2:3:elastic-hs-x",
                   "memfd:1:2:3:other-name"):
        with pytest.raises(ValueError, match="malformed handle"):
            HostStore.attach(handle, PAGE, impl=impl)
    with HostStore.create(PAGE, impl=impl) as s:
        with pytest.raises(ValueError, match="positive"):
            HostStore.attach(s.handle, 0, impl=impl)
        for wrong in (PAGE - 1, 2 * PAGE):
            with pytest.raises(HostStoreError, match="size mismatch.*has 4096 bytes") as info:
                HostStore.attach(s.handle, wrong, impl=impl)
            assert info.value.errno == errno.EINVAL and s.handle in str(info.value)


def test_handle_of_a_dead_process(impl):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that existed and is gone (reuse within this test is improbable)
    handle = f"memfd:{child.pid}:3:12345:elastic-hs-{child.pid}-0123456789abcdef"
    with pytest.raises(HostStoreError, match=f"process {child.pid} is gone") as info:
        HostStore.attach(handle, PAGE, impl=impl)
    assert info.value.errno == errno.ENOENT and "No such file or directory" in str(info.value)


def test_closed_or_reused_fd_is_refused(impl):
    s = HostStore.create(PAGE, impl=impl)
    s.close_fd()
    with pytest.raises(HostStoreError, match="no longer has fd"):
        HostStore.attach(s.handle, PAGE, impl=impl)
    # The fd number now names another file: the inode / name check refuses it.
    fd_no = int(s.handle.split(":")[2])
    other = os.open(os.devnull, os.O_RDONLY)
    try:
        if other != fd_no:
            os.dup2(other, fd_no)
        with pytest.raises(HostStoreError, match="not the memfd") as info:
            HostStore.attach(s.handle, PAGE, impl=impl)
        assert info.value.errno == errno.ESTALE
    finally:
        if other != fd_no:
            os.close(fd_no)
        os.close(other)
    with pytest.raises(HostStoreError, match="shm_open.*No such file"):  # an unlinked shm name
        t = HostStore.create(PAGE, kind="shm", impl=impl)
        t.close_fd()
        HostStore.attach(t.handle, PAGE, impl=impl)
    s.close()


def test_world_one_and_bad_arguments():
    seen = []
    store = node_host_store(PAGE + 1, fill=lambda st, lr, lw: seen.append((lr, lw)) or st.tensor().fill_(3))
    assert seen == [(0, 1)] and not store.fd_open and bool((store.tensor() == 3).all())
    store.close()
    with pytest.raises(ValueError, match="positive"):
        node_host_store(0)
    with pytest.raises(ValueError, match="kind"):
        node_host_store(PAGE, kind="file")

    names = []

    def boom(st, lr, lw):
        names.append(st.handle.rsplit(":", 1)[1])
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        node_host_store(PAGE, fill=boom)
    gc.collect()
    assert names and mapped_anywhere(names[0]) == []  # closed on the way out


def test_local_share_covers_every_byte_once():
    for n in (1, PAGE - 1, PAGE, 7 * PAGE + 3, 10 * MIB + 1):
        for lw in (1, 2, 3, 4, 7):
            shares = [local_share(n, lr, lw) for lr in range(lw)]
            assert shares[0][0] == 0 and shares[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
            assert all(s[0] % PAGE == 0 for s in shares)
    with pytest.raises(ValueError):
        local_share(10, 2, 2)


# --------------------------------------------------------------------------------------------
# Several processes: the node handshake.
# --------------------------------------------------------------------------------------------


def _contents_worker(rank, world_size, nbytes, fake_nodes, kind, impl):
    import elastic_kernels.api.host.store as hs

    if fake_nodes:  # ranks 0,1 / 2,3 ... pretend to be separate nodes
        hs.node_identity = lambda: f"fake-node-{rank // 2}"
    node = rank // 2 if fake_nodes else 0
    fills = []

    def fill(store, local_rank, local_world):
        start, stop = local_share(store.nbytes, local_rank, local_world)
        store.tensor()[start:stop].copy_(pattern(start, stop, salt=node))
        fills.append((local_rank, local_world, start, stop))

    store = node_host_store(nbytes, fill=fill, timeout_s=60, kind=kind, impl=impl)
    ok = torch.equal(store.tensor(), pattern(0, nbytes, salt=node))
    out = dict(rank=rank, handle=store.handle, creator=store.creator, fd_open=store.fd_open, ok=ok,
               fills=fills, impl=store.impl, kind=store.kind)
    store.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_share_seen_by_every_rank(world_size):
    n = 5 * MIB + 3 * PAGE + 7  # ragged: the last share ends mid-page
    out = run_distributed(_contents_worker, world_size, n, False, None, "auto", timeout=120)
    assert all(o["ok"] for o in out), [o["rank"] for o in out if not o["ok"]]
    assert len({o["handle"] for o in out}) == 1  # one segment for the node
    assert [o["creator"] for o in out] == [True] + [False] * (world_size - 1)
    assert not any(o["fd_open"] for o in out)
    shares = sorted((f[2], f[3]) for o in out for f in o["fills"])
    assert shares[0][0] == 0 and shares[-1][1] == n and all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert sorted(f[0] for o in out for f in o["fills"]) == list(range(world_size))


@pytest.mark.distributed
def test_one_segment_per_node():
    out = run_distributed(_contents_worker, 4, 3 * PAGE + 1, True, None, "auto", timeout=120)
    assert all(o["ok"] for o in out)  # each rank sees its own node's contents (salted per node)
    assert out[0]["handle"] == out[1]["handle"] != out[2]["handle"] == out[3]["handle"]
    assert [o["creator"] for o in out] == [True, False, True, False]
    assert [o["fills"][0][:2] for o in out] == [(0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.distributed
@pytest.mark.parametrize("kind,impl", [("shm", "auto"), ("memfd", "python")])
def test_forced_kind_and_implementation(kind, impl):
    before = set(os.listdir("/dev/shm"))
    out = run_distributed(_contents_worker, 2, MIB + 1, False, kind, impl, timeout=120)
    assert all(o["ok"] and o["kind"] == kind for o in out)
    if impl == "python":
        assert all(o["impl"] == "python" for o in out)
    assert not {e for e in set(os.listdir("/dev/shm")) - before if e.startswith("elastic-hs-")}


def _mismatch_worker(rank, world_size):
    try:
        node_host_store(PAGE * (1 + rank), timeout_s=30)  # ranks disagree on the size
    except HostStoreSetupError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_attach_failure_is_an_error_on_every_rank():
    out = run_distributed(_mismatch_worker, 2, timeout=60)
    assert all(o and "size mismatch" in o and "on rank 1" in o for o in out), out


def _slow_fill_worker(rank, world_size, timeout_s, sleep_s, gave_up):
    """Rank 1's fill is stuck for `sleep_s`, or until rank 0 has given up (it writes the file
    `gave_up` after its timeout): the rest of the sleep proves nothing."""
    def fill(store, local_rank, local_world):
        if rank == 1:
            until = time.monotonic() + sleep_s
            while time.monotonic() < until and not os.path.exists(gave_up):
                time.sleep(0.05)

    dist.barrier()  # the ranks start together: the short collectives' timeout is tight on purpose
    t0 = time.monotonic()
    try:
        node_host_store(PAGE, fill=fill, timeout_s=timeout_s)
    except HostStoreSetupError as exc:
        elapsed = time.monotonic() - t0
        if rank == 0:
            with open(gave_up, "w") as f:
                f.write(str(elapsed))
        return elapsed, str(exc)
    return time.monotonic() - t0, None


@pytest.mark.distributed
def test_a_rank_stuck_in_its_fill_is_an_error_after_the_timeout(tmp_path):
    out = run_distributed(_slow_fill_worker, 2, 2.0, 10.0, str(tmp_path / "rank0_gave_up"), timeout=120)
    elapsed, err = out[0]
    # The default set-up bound of a one-page store is timeout_s (plus 16 us).
    assert err is not None and "timed out" in err and "page-locking and filling every rank's share" in err, err
    assert "not finished on rank(s) [1] (rank 1 filling its share" in err, err
    assert 2.0 <= elapsed < 8.0, f"rank 0 waited {elapsed:.1f} s with timeout_s=2"
    assert out[1][1] is not None  # the stuck rank then fails too: its peer has gone


# ---- one copy per node, measured ----

STORE_BYTES = 256 * MIB
# Fixed overhead allowed on top of 1.1 x S for the 4 ranks together: the handshake's gloo
# buffers and pickles, the verification's small temporaries and allocator slack, 8 MiB a rank.
OVERHEAD_BYTES = 4 * 8 * MIB
READ_CHUNK = 16 * MIB


def _read_all(t: torch.Tensor, expect_of) -> bool:
    """Touch every page (as a rank copying any chunk would) and check the share values."""
    ok = True
    for start in range(0, t.numel(), READ_CHUNK):
        c = t[start:start + READ_CHUNK]
        lo, hi = int(c.min()), int(c.max())
        ok &= lo == hi == expect_of(start)
    return ok


def _memory_worker(rank, world_size, nbytes):
    def fill(store, local_rank, local_world):
        start, stop = local_share(store.nbytes, local_rank, local_world, align=READ_CHUNK)
        store.tensor()[start:stop].fill_(local_rank + 1)

    gc.collect()
    dist.barrier()
    pss0 = pss_kib()
    store = node_host_store(nbytes, fill=fill, timeout_s=120)
    share_of = lambda off: next(lr + 1 for lr in range(world_size)  # noqa: E731
                                if local_share(nbytes, lr, world_size, READ_CHUNK)[0] <= off
                                < local_share(nbytes, lr, world_size, READ_CHUNK)[1])
    ok = _read_all(store.tensor(), share_of)
    dist.barrier()
    shared_growth = (pss_kib() - pss0) * 1024
    store.close()
    del store
    gc.collect()
    dist.barrier()

    # The existing path: every rank holds its own full copy in a private tensor.
    pss1 = pss_kib()
    private = torch.empty(nbytes, dtype=torch.uint8)
    private.fill_(rank + 1)
    ok &= _read_all(private, lambda off: rank + 1)
    dist.barrier()
    private_growth = (pss_kib() - pss1) * 1024
    del private
    return ok, shared_growth, private_growth


@pytest.mark.distributed
def test_one_copy_per_node_measured():
    shmem0 = shmem_kib()
    out = run_distributed(_memory_worker, 4, STORE_BYTES, timeout=300)
    assert all(ok for ok, _, _ in out)
    shared = sum(s for _, s, _ in out)
    private = sum(p for _, _, p in out)
    s = STORE_BYTES
    print(f"\n4 local ranks, store S = {s >> 20} MiB: node memory growth (sum of Pss) "
          f"host store {shared / 2**20:.1f} MiB = {shared / s:.3f} S "
          f"(per rank {[round(x / 2**20, 1) for _, x, _ in out]} MiB); "
          f"private copy per rank {private / 2**20:.1f} MiB = {private / s:.3f} S; "
          f"Shmem after exit {shmem_kib() - shmem0:+d} KiB")
    assert shared <= 1.1 * s + OVERHEAD_BYTES, f"the host store costs {shared / s:.3f} S, not one copy"
    assert shared >= 0.9 * s  # the measurement sees the segment at all
    assert private >= 3.6 * s, f"the private path measured {private / s:.3f} S, expected about 4 S"


# --------------------------------------------------------------------------------------------
# No leaks: plain subprocesses, a rank killed at a known point.
# --------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from elastic_kernels.api.host.store import HostStoreSetupError, local_share, node_host_store

    rank, world, init, out, scenario, victim, kind, impl, timeout, nbytes = sys.argv[1:]
    rank, world, victim, timeout, nbytes = int(rank), int(world), int(victim), float(timeout), int(nbytes)
    torch.set_num_threads(1)
    # The rendezvous has its own generous bound (the ranks' start-ups differ on a loaded
    # machine); `timeout` bounds node_host_store's collectives and set-up waits, what is tested.
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=max(timeout, 120)))

    def fill(store, lr, lw):
        a, b = local_share(store.nbytes, lr, lw)
        store.tensor()[a:b].fill_(lr + 1)
        # Written whole, then renamed: the test kills this rank as soon as the file exists.
        with open(os.path.join(out, f"ready.{rank}.tmp"), "w") as f:
            f.write(store.handle)
        os.replace(os.path.join(out, f"ready.{rank}.tmp"), os.path.join(out, f"ready.{rank}"))
        if rank == victim and scenario == "raise":
            raise RuntimeError("boom in the fill of rank %d" % rank)
        if rank == victim and scenario in ("sigterm", "sigkill"):
            time.sleep(600)  # the test kills this rank here

    try:
        store = node_host_store(nbytes, fill=fill, timeout_s=timeout, kind=None if kind == "auto" else kind,
                                impl=impl)
    except HostStoreSetupError as exc:
        with open(os.path.join(out, f"error.{rank}"), "w") as f:
            f.write(str(exc))
        # A peer is gone: end the group without a collective (gloo's threads would otherwise be
        # torn down at interpreter exit, pytorch#190489), then exit with the agreed code.
        dist.destroy_process_group()
        sys.exit(3)
    assert int(store.tensor()[0]) == 1
    dist.barrier()
    dist.destroy_process_group()  # every child ends its process group (issue 17, the flake)
    """
)

LEAK_BYTES = 64 * MIB
CHILD_TIMEOUT_S = 8.0  # node_host_store(timeout_s=): a survivor waits this (plus 1 s per SETUP_BYTES_PER_S)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "scenario,victim,kind,impl",
    [
        ("normal", -1, "auto", "auto"),
        ("normal", -1, "shm", "auto"),
        ("raise", 1, "auto", "auto"),
        ("sigterm", 1, "auto", "auto"),
        ("sigkill", 1, "auto", "auto"),
        ("sigkill", 0, "auto", "auto"),  # the creator
        ("sigkill", 1, "shm", "auto"),
        ("sigkill", 0, "auto", "python"),
    ],
)
def test_no_leak(tmp_path, scenario, victim, kind, impl):
    world = 2
    shm_before = set(os.listdir("/dev/shm"))
    shmem0 = shmem_kib()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(tmp_path / "rdzv"), str(tmp_path), scenario,
             str(victim), kind, impl, str(CHILD_TIMEOUT_S), str(LEAK_BYTES)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    try:
        killed_at = None
        if scenario in ("sigterm", "sigkill"):
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"ready.{r}").exists() for r in range(world)):
                assert time.monotonic() < deadline, "the ranks never reached the fill"
                assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
                time.sleep(0.05)
            procs[victim].send_signal(signal.SIGTERM if scenario == "sigterm" else signal.SIGKILL)
            killed_at = time.monotonic()
        outputs = [p.communicate(timeout=180)[0] for p in procs]
        ended_at = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    name = (tmp_path / "ready.0").read_text().rsplit(":", 1)[1]

    if scenario == "normal":
        assert codes == [0] * world, outputs
    elif scenario == "raise":
        assert codes == [3] * world, outputs
        for r in range(world):
            assert "boom in the fill of rank 1" in (tmp_path / f"error.{r}").read_text()
    else:
        sig = signal.SIGTERM if scenario == "sigterm" else signal.SIGKILL
        assert codes[victim] == -sig, outputs
        for r in range(world):
            if r != victim:
                assert codes[r] == 3, outputs[r]
                assert "peer rank probably failed" in (tmp_path / f"error.{r}").read_text()
        # Survivors fail within the collective timeout (plus process exit), not a hang.
        assert ended_at - killed_at < CHILD_TIMEOUT_S + 10, f"survivors took {ended_at - killed_at:.1f} s"

    # Nothing left: no name in /dev/shm, no process maps or holds the segment, memory back.
    assert not {e for e in set(os.listdir("/dev/shm")) - shm_before if e.startswith("elastic-hs-")}
    assert mapped_anywhere(name) == []
    growth = shmem_kib() - shmem0
    assert growth * 1024 < LEAK_BYTES // 2, f"Shmem grew by {growth} KiB after every rank exited"


# --------------------------------------------------------------------------------------------
# Issue 17: a failed registration, the set-up's own bound, the memory check, the symmetric
# shm retry, pinned bytes once per node.
# --------------------------------------------------------------------------------------------


def _failing_pin(fail: bool):
    """A HostStore.pin that fails as cudaHostRegister does (or succeeds, counting the store)."""
    def pin(self, device=None):
        if fail:
            raise HostStoreError(errno.ENOMEM, f"HostStore.pin({self.handle}): cudaHostRegister failed: out of memory")
        return True
    return pin


def test_failed_pin_warns_and_continues_unpinned(monkeypatch):
    """Issue 17 #7: a failed `cudaHostRegister` is a warning, not the end of the job: the store
    is created, filled and usable, unpinned."""
    monkeypatch.setattr(HostStore, "pin", _failing_pin(True))
    with pytest.warns(RuntimeWarning, match="could not be page-locked.*cudaHostRegister failed: out of memory"):
        store = node_host_store(PAGE, device="cuda", fill=lambda st, lr, lw: st.tensor().fill_(7))
    try:
        assert bool((store.tensor() == 7).all()) and not store.pinned and store.pinned_bytes == 0
    finally:
        store.close()


def _pin_worker(rank, world_size, failing_ranks):
    import warnings

    import elastic_kernels.api.host.store as hs

    hs.node_identity = lambda: f"fake-node-{rank // 2}"
    HostStore.pin = _failing_pin(rank in failing_ranks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store, info = hs.build_node_host_store(PAGE, fill=lambda st, lr, lw: None, timeout_s=60, device="cuda")
    store.close()
    return info.pinned, info.reports_pinned, [str(w.message) for w in caught if "page-locked" in str(w.message)]


@pytest.mark.distributed
def test_failed_pin_on_one_rank_and_pinned_bytes_once_per_node():
    """Issue 17 #7 and #9: rank 0's registration fails (it warns, everyone continues); the
    store's pinned bytes are reported by one rank per node, the lowest that pinned."""
    out = run_distributed(_pin_worker, 4, (0,), timeout=120)
    pinned = [o[0] for o in out]
    assert pinned == [(False, True), (False, True), (True, True), (True, True)], pinned
    assert [o[1] for o in out] == [False, True, True, False]
    assert [len(o[2]) for o in out] == [1, 0, 0, 0], [o[2] for o in out]


def _stats_pinned_worker(rank, world_size):
    import elastic_kernels.api.host.store as hs
    from elastic_kernels.api import ElasticPolicy, elasticize, stats
    from tests.runtime.test_runtime import make_model

    hs.node_identity = lambda: f"fake-node-{rank // 2}"
    HostStore.pin = _failing_pin(False)
    HostStore.pinned_bytes = property(lambda self: self.nbytes)  # as a pinned mapping reports it
    model = make_model()
    # A CUDA device is what makes the handshake pin the store; on CPU it is asked to directly.
    import elastic_kernels.api.runtime._registration as reg

    for name in ("build_node_host_store", "node_host_store"):  # whichever the runtime calls
        if hasattr(reg, name):
            setattr(reg, name, functools.partial(lambda real, *a, **k: real(*a, **dict(k, device="cuda")),
                                                 getattr(reg, name)))
    elasticize(model, ElasticPolicy(chunk_bytes=24 * 4 * 7, weights_on="host"))
    s = stats(model)
    return s["host_pinned_bytes"], s["host_store_bytes"]


@pytest.mark.distributed
def test_host_pinned_bytes_sum_to_one_store_per_node():
    """Issue 17 #9: summed over a node's ranks, `host_pinned_bytes` is the store once, not once
    per local rank (4 ranks as 2 nodes of 2)."""
    out = run_distributed(_stats_pinned_worker, 4, timeout=180)
    size = out[0][1]
    assert size > 0 and all(o[1] == size for o in out)
    assert out[0][0] + out[1][0] == size and out[2][0] + out[3][0] == size, out


def test_store_larger_than_available_memory_is_refused(monkeypatch):
    """Issue 17 #7: a store larger than the memory the node can give is refused before anything
    is reserved, with an error naming both sizes (the reading of available memory is faked;
    nothing large is allocated)."""
    import elastic_kernels.host_store as ehs

    monkeypatch.setattr(ehs, "available_host_bytes", lambda: 3 * MIB, raising=False)
    for impl in ("python",) + (("cpp",) if not _skips.ext_skip_reason() else ()):
        with pytest.raises(HostStoreError, match=r"needs 4194304 bytes \(4 MiB\) but this node has only 3145728 "
                                                 r"bytes \(3 MiB\) available") as info:
            HostStore.create(4 * MIB, impl=impl)
        assert info.value.errno == errno.ENOMEM
    with HostStore.create(2 * MIB) as s:  # within what is available: created
        assert s.nbytes == 2 * MIB


def test_available_host_bytes_reads_this_machine():
    from elastic_kernels.host_store import available_host_bytes

    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    avail = available_host_bytes()
    assert avail is not None and 0 < avail <= meminfo["MemTotal"]
    assert avail <= meminfo["MemAvailable"] + 256 * MIB  # read just now (the machine is shared)


def _refused_worker(rank, world_size):
    import elastic_kernels.host_store as ehs

    ehs.available_host_bytes = lambda: 3 * MIB
    try:
        node_host_store(4 * MIB, timeout_s=60)
    except HostStoreSetupError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_store_larger_than_available_memory_fails_every_rank():
    out = run_distributed(_refused_worker, 2, timeout=120)
    assert all(o is not None and "but this node has only 3145728 bytes" in o for o in out), out


def _setup_bound_worker(rank, world_size, timeout_s, setup_timeout_s, sleep_s, gave_up=None):
    """Rank 1's fill takes `sleep_s`, or, where `gave_up` names a file, ends early once rank 0
    has given up (written there after its timeout): the fill was still running past the bound,
    the rest of the sleep proves nothing."""
    def fill(store, local_rank, local_world):
        if rank == 1:
            until = time.monotonic() + sleep_s
            while time.monotonic() < until and not (gave_up and os.path.exists(gave_up)):
                time.sleep(0.05)

    dist.barrier()  # the ranks start together: the short collectives' timeout is tight on purpose
    t0 = time.monotonic()
    try:
        node_host_store(PAGE, fill=fill, timeout_s=timeout_s, setup_timeout_s=setup_timeout_s)
    except HostStoreSetupError as exc:
        elapsed = time.monotonic() - t0
        if gave_up and rank == 0:
            with open(gave_up, "w") as f:
                f.write(str(elapsed))
        return elapsed, str(exc)
    return time.monotonic() - t0, None


@pytest.mark.distributed
def test_setup_has_its_own_bound_and_names_the_slow_stage(tmp_path):
    """Issue 17 #7: a fill slower than the collective timeout succeeds within the set-up bound
    (the process group's own timeout is 20 s here, the collective timeout 2 s, the fill 5 s);
    a fill slower than the set-up bound fails every rank with a message naming the stage, the
    slow rank and what it was doing, not blaming a peer."""
    out = run_distributed(_setup_bound_worker, 2, 3.0, 30.0, 8.0, timeout=90)
    assert [o[1] for o in out] == [None, None], out
    assert out[0][0] >= 8.0, out  # it did wait for the slow fill
    out = run_distributed(_setup_bound_worker, 2, 3.0, 3.0, 14.0, str(tmp_path / "rank0_gave_up"), timeout=90)
    elapsed, err = out[0]
    assert err is not None and "timed out" in err and "page-locking and filling" in err, err
    assert "not finished on rank(s) [1] (rank 1 filling its share of the store for" in err, err
    assert "ElasticPolicy.host_setup_timeout_s" in err, err
    assert 3.0 <= elapsed < 12.0, f"rank 0 waited {elapsed:.1f} s with a set-up bound of 3 s (the fill takes 14 s)"
    assert out[1][1] is not None and "timed out" in out[1][1], out[1]  # the slow rank fails too


def test_setup_bound_scales_with_the_store():
    from elastic_kernels.api.host.store import SETUP_BYTES_PER_S, setup_bound_s

    assert setup_bound_s(140 * 10**9, 300.0) == pytest.approx(300.0 + 140 * 10**9 / SETUP_BYTES_PER_S)
    assert setup_bound_s(140 * 10**9, 300.0) > 800  # 140 GB: longer than the collective timeout
    assert setup_bound_s(PAGE, 300.0, 42.0) == 42.0 and setup_bound_s(PAGE, None) is None


def _retry_worker(rank, world_size, timeout_s):
    """4 ranks as 2 nodes: node 0 (ranks 0, 1) shares a PID namespace (memfd) but its attach of
    a memfd fails; node 1 (ranks 2, 3) has ranks in different PID namespaces (shm from the
    start)."""
    import elastic_kernels.api.host.store as hs

    hs.node_identity = lambda: f"fake-node-{rank // 2}"
    hs._pid_namespace = lambda: 1 if rank < 2 else 100 + rank
    real_attach = HostStore.attach.__func__

    def attach(cls, handle, nbytes, *, impl="auto"):
        if handle.startswith("memfd:"):
            raise HostStoreError(errno.EACCES, f"HostStore.attach({handle}): cannot open /proc/.../fd: Permission denied")
        return real_attach(cls, handle, nbytes, impl=impl)

    HostStore.attach = classmethod(attach)
    node = rank // 2

    def fill(store, local_rank, local_world):
        start, stop = local_share(store.nbytes, local_rank, local_world)
        store.tensor()[start:stop].copy_(pattern(start, stop, salt=node))

    dist.barrier()
    t0 = time.monotonic()
    try:
        store = node_host_store(3 * PAGE, fill=fill, timeout_s=timeout_s)
    except HostStoreSetupError as exc:
        return dict(error=str(exc), elapsed=time.monotonic() - t0)
    out = dict(error=None, kind=store.kind, ok=torch.equal(store.tensor(), pattern(0, 3 * PAGE, salt=node)),
               handle=store.handle)
    store.close()
    return out


@pytest.mark.distributed
def test_shm_retry_is_taken_by_every_rank_alike():
    """Issue 17 #8: the memfd -> shm retry is decided from the exchanged outcomes: node 0's
    failed memfd attach makes node 0 retry with shm while node 1 (shm from the start) keeps its
    segment and takes part in the second round; nobody hangs, each node sees its own contents."""
    out = run_distributed(_retry_worker, 4, 30.0, timeout=120)
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    assert [o["kind"] for o in out] == ["shm"] * 4
    assert all(o["ok"] for o in out)
    assert out[0]["handle"] == out[1]["handle"] != out[2]["handle"] == out[3]["handle"]
