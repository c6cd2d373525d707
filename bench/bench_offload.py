"""Host store -> pool page copies, against one plain copy of the same bytes.

    python bench/bench_offload.py [--device cpu|cuda] [--mib N] [--chunk-kib K ...] [--repeats R]
                                  [--threads T] [--results DIR] [--no-layer-loop]
                                  [--layers L] [--d-in D] [--d-out D] [--tokens T] [--lora-rank R]

Copies N MiB (in chunks of K KiB, chunk-major as the host store holds frozen weights) from an
``elastic_kernels.HostStore`` into pages of an ``elastic_kernels.PagePool`` on the device, in
one run against its baselines (median of several repeats after warm-up):

  store_per_chunk        one ``page.copy_(chunk, non_blocking=True)`` per chunk
  store_batched          one copy per run of chunks whose pages are contiguous (pool segments)
  reference_copy         one ``copy_`` of the same bytes from a torch tensor: on cuda a pinned
                         one (``pin_memory=True``), the ceiling; on cpu an ordinary tensor
  pageable_copy          one ``copy_`` from ordinary (pageable) memory
  store_unpinned_batched (cuda) store_batched with the store's registration removed

On cuda the store is page-locked with ``HostStore.pin`` (cudaHostRegister) and the copies run on
a dedicated copy stream; ``ratio_vs_reference`` is the share of the pinned copy's bandwidth
(issue 11's target on H200: >= 0.9 for the store rows). The layer loop (cuda only) then streams
L layers of frozen bf16 weights from the pinned store into a two-layer window of pool pages on
the copy stream while the compute stream runs each layer's GEMM with a LoRA term
(``x @ W^T + (x @ A^T) @ B^T``), and reports the share of the copy time hidden behind the GEMMs:
``hidden = 1 - (t_overlapped - t_compute_only) / t_copy_only`` (target >= 0.9; it can only
reach 1 when the GEMMs take at least as long as the copies, so compute/copy is printed too).

CPU rows measure memcpy between two host buffers: they say nothing about PCIe or DMA, only
that the paths cost no more than a plain copy (per-chunk overhead in Python and torch). Rows
go to bench/results/offload.csv (or --results / $ELASTIC_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from elastic_kernels import HostStore, PagePool  # noqa: E402
from elastic_kernels.api.finetune.measure import device_name  # noqa: E402

TARGET_RATIO = 0.9  # store copies vs the pinned copy, and copy time hidden in the layer loop (H200)


def _machine() -> str:
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return f"{device_name('cpu')}, {mem:.0f} GiB"


def contiguous_runs(pages: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """[(first chunk, end chunk, one uint8 view over their pages)] for maximal runs of
    consecutive chunks whose pages are adjacent in one allocation (a pool segment)."""
    runs = []
    i = 0
    while i < len(pages):
        j = i + 1
        storage = pages[i].untyped_storage().data_ptr()
        while (
            j < len(pages)
            and pages[j].untyped_storage().data_ptr() == storage
            and pages[j].data_ptr() == pages[j - 1].data_ptr() + pages[j - 1].numel()
        ):
            j += 1
        first = pages[i]
        n = sum(p.numel() for p in pages[i:j])
        view = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (n,))
        runs.append((i, j, view))
        i = j
    return runs


def bench_copies(device: torch.device, total: int, chunk: int, repeats: int, copy_stream, store: HostStore) -> list[dict]:
    n_chunks = total // chunk
    src = store.tensor()[: n_chunks * chunk]
    nbytes = n_chunks * chunk
    rows = []
    ctx = {**harness.context(device), "machine": _machine()}

    def row(op, seconds, copies, ref_gbps=None):
        gbps = nbytes / seconds / 1e9
        return {
            **ctx,
            "op": op,
            "bytes": nbytes,
            "chunk_bytes": chunk,
            "copies_per_iter": copies,
            "ms": round(seconds * 1e3, 4),
            "gb_per_s": round(gbps, 3),
            "ratio_vs_reference": round(gbps / ref_gbps, 3) if ref_gbps else 1.0,
            "store_pinned": store.pinned,
        }

    def on_stream(fn):
        if copy_stream is None:
            return fn

        def run():
            with torch.cuda.stream(copy_stream):
                fn()

        return run

    nb = device.type == "cuda"
    # Baselines: one copy_ of the same bytes.
    reference_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=nb)
    reference_src.copy_(src)
    pageable_src = torch.empty(nbytes, dtype=torch.uint8)
    pageable_src.copy_(src)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t_ref = harness.measure(on_stream(lambda: flat_dst.copy_(reference_src, non_blocking=nb)), device, repeats=repeats)
    ref = nbytes / t_ref / 1e9
    rows.append(row("reference_copy", t_ref, 1, ref))
    t = harness.measure(on_stream(lambda: flat_dst.copy_(pageable_src, non_blocking=nb)), device, repeats=repeats)
    rows.append(row("pageable_copy", t, 1, ref))
    flat_dst = reference_src = pageable_src = None  # freed (not del: the lambdas close over them)

    with PagePool(chunk, nbytes, device) as pool:
        slots = pool.allocate_many(list(range(n_chunks)))
        pages = [pool.page(s) for s in slots]
        runs = contiguous_runs(pages)
        src_chunks = [src[i * chunk:(i + 1) * chunk] for i in range(n_chunks)]
        src_runs = [(view, src[a * chunk:b * chunk]) for a, b, view in runs]

        def per_chunk():
            for page, s in zip(pages, src_chunks):
                page.copy_(s, non_blocking=nb)

        def batched():
            for view, s in src_runs:
                view.copy_(s, non_blocking=nb)

        t = harness.measure(on_stream(per_chunk), device, repeats=repeats)
        rows.append(row("store_per_chunk", t, n_chunks, ref))
        t = harness.measure(on_stream(batched), device, repeats=repeats)
        rows.append(row("store_batched", t, len(runs), ref))
        # The copies landed where they should (checked once, outside the timing).
        harness.synchronize(device)
        for i in (0, n_chunks // 2, n_chunks - 1):
            if not torch.equal(pages[i].cpu(), src_chunks[i]):
                raise AssertionError(f"chunk {i} was not copied into its page")
        if store.pinned:
            store.unpin()
            try:
                t = harness.measure(on_stream(batched), device, repeats=repeats)
                rows.append(row("store_unpinned_batched", t, len(runs), ref))
            finally:
                store.pin(device)
    return rows


def layer_loop(device, store: HostStore, args, copy_stream) -> dict:
    """Stream L layers host store -> a two-layer window of pool pages while GEMMs run."""
    d_in, d_out, L, tokens, r = args.d_in, args.d_out, args.layers, args.tokens, args.lora_rank
    dtype = torch.bfloat16
    layer_bytes = d_in * d_out * dtype.itemsize
    chunk = args.layer_chunk_kib * 1024
    if layer_bytes % chunk or chunk % (d_in * dtype.itemsize):
        raise ValueError(f"layer loop: a layer of {layer_bytes} bytes must be whole chunks of whole rows")
    per_layer = layer_bytes // chunk
    if store.nbytes < L * layer_bytes:
        raise ValueError(f"layer loop: the store has {store.nbytes} bytes, {L} layers need {L * layer_bytes}")
    src = store.tensor()
    g = torch.Generator().manual_seed(0)
    src[: L * layer_bytes].view(dtype).copy_((torch.randn(L * layer_bytes // 2, generator=g) * 0.02).to(dtype))

    compute = torch.cuda.current_stream(device)
    x = torch.randn(tokens, d_in, device=device, dtype=dtype)
    A = torch.randn(r, d_in, device=device, dtype=dtype) * 0.01
    B = torch.randn(d_out, r, device=device, dtype=dtype) * 0.01
    y = torch.empty(tokens, d_out, device=device, dtype=dtype)

    # A window of two layers: buffer b holds chunks (b, 0..per_layer-1). Segments of one layer
    # each, so a layer's pages are one contiguous run and its GEMM one call.
    with PagePool(chunk, 2 * layer_bytes, device, segment_bytes=layer_bytes) as pool:
        buffers = []
        for b in range(2):
            slots = pool.allocate_many([b * per_layer + j for j in range(per_layer)])
            runs = contiguous_runs([pool.page(s) for s in slots])
            buffers.append(runs)
        src_runs = [
            [(view, src[l * layer_bytes + a * chunk: l * layer_bytes + bb * chunk]) for a, bb, view in buffers[l % 2]]
            for l in range(L)
        ]

        def weight_runs(b):
            # [(row0, row1, weight rows)] of buffer b
            rows_per_chunk = chunk // (d_in * dtype.itemsize)
            return [(a * rows_per_chunk, bb * rows_per_chunk, view.view(dtype).view(-1, d_in)) for a, bb, view in buffers[b]]

        wruns = [weight_runs(0), weight_runs(1)]
        xa = torch.empty(tokens, r, device=device, dtype=dtype)
        lora = torch.empty(tokens, d_out, device=device, dtype=dtype)

        def gemm(b):
            """y = x @ W_b^T + (x @ A^T) @ B^T, W_b read from the pages of buffer b."""
            torch.mm(x, A.t(), out=xa)
            torch.mm(xa, B.t(), out=lora)
            if len(wruns[b]) == 1:  # the layer's pages are one run: one GEMM, no allocation
                torch.addmm(lora, x, wruns[b][0][2].t(), out=y)
                return
            for r0, r1, w in wruns[b]:
                y[:, r0:r1] = torch.addmm(lora[:, r0:r1], x, w.t())

        def copy_layer(l):
            for view, s in src_runs[l]:
                view.copy_(s, non_blocking=True)

        def copies_only():
            with torch.cuda.stream(copy_stream):
                for l in range(L):
                    copy_layer(l)

        def compute_only():
            for l in range(L):
                gemm(l % 2)

        copied = [torch.cuda.Event() for _ in range(2)]
        computed = [torch.cuda.Event() for _ in range(2)]

        def overlapped():
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_stream(compute)  # the window's previous readers are done
                copy_layer(0)
                copied[0].record(copy_stream)
            for l in range(L):
                b = l % 2
                if l + 1 < L:  # prefetch the next layer into the other buffer, once its last reader ran
                    nb = (l + 1) % 2
                    with torch.cuda.stream(copy_stream):
                        if l >= 1:
                            copy_stream.wait_event(computed[nb])
                        copy_layer(l + 1)
                        copied[nb].record(copy_stream)
                compute.wait_event(copied[b])
                gemm(b)
                computed[b].record(compute)

        t_copy = harness.measure(copies_only, device, warmup=2, repeats=args.repeats)
        t_compute = harness.measure(compute_only, device, warmup=2, repeats=args.repeats)
        t_both = harness.measure(overlapped, device, warmup=2, repeats=args.repeats)
        # Correctness of the streamed weights: the last layer's GEMM matches a reference.
        torch.cuda.synchronize(device)
        w_last = src[(L - 1) * layer_bytes: L * layer_bytes].view(dtype).view(d_out, d_in).to(device)
        ref = x @ w_last.t() + (x @ A.t()) @ B.t()
        err = (y.float() - ref.float()).abs().max().item()
        if not err <= 0.05 * ref.float().abs().max().item() + 1e-2:
            raise AssertionError(f"layer loop: the streamed weights computed a wrong result (max error {err})")

    hidden = max(0.0, min(1.0, 1.0 - (t_both - t_compute) / t_copy))
    return {
        **harness.context(device), "machine": _machine(),
        "layers": L, "layer_bytes": layer_bytes, "chunk_bytes": chunk, "tokens": tokens, "d_in": d_in, "d_out": d_out,
        "lora_rank": r, "copy_only_ms": round(t_copy * 1e3, 3), "compute_only_ms": round(t_compute * 1e3, 3),
        "overlapped_ms": round(t_both * 1e3, 3), "copy_gb_per_s": round(L * layer_bytes / t_copy / 1e9, 3),
        "compute_over_copy": round(t_compute / t_copy, 3), "hidden_fraction": round(hidden, 3),
        "store_pinned": store.pinned,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mib", type=int, default=None, help="bytes copied per iteration (default 256 on cpu, 1024 on cuda)")
    ap.add_argument("--chunk-kib", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads; default 1 on cpu (two OpenMP threads on two shared cores stall "
                         "at barriers and per-chunk copies of 2 MiB measured 15x slower: see NOTES.md)")
    ap.add_argument("--results", default=None, help="folder for offload.csv (default bench/results)")
    ap.add_argument("--no-layer-loop", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-in", type=int, default=4096)
    ap.add_argument("--d-out", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384, help="GEMM rows per layer (sized so compute >= copy on H200)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--layer-chunk-kib", type=int, default=2048)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    copy_stream = None
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        copy_stream = torch.cuda.Stream(device)  # the offload (host -> page) stream of this benchmark
    total = (args.mib or (1024 if device.type == "cuda" else 256)) << 20
    layer_total = args.layers * args.d_in * args.d_out * 2 if device.type == "cuda" and not args.no_layer_loop else 0

    t0 = time.perf_counter()
    store = HostStore.create(max(total, layer_total))
    store.tensor()[:total].copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    if device.type == "cuda":
        if not store.pin(device):
            print("warning: the host store could not be pinned (built without CUDA?): store rows are pageable")
    print(f"host store: {store.nbytes >> 20} MiB ({store.impl}, pinned={store.pinned}), set up in "
          f"{time.perf_counter() - t0:.1f} s; device {device_name(device)}")
    if device.type == "cpu":
        print("CPU rows: memcpy between host buffers; they say nothing about PCIe or DMA.")

    rows = []
    for kib in args.chunk_kib:
        rows += bench_copies(device, total, kib * 1024, args.repeats, copy_stream, store)
    harness.print_table(rows, ["op", "chunk_bytes", "copies_per_iter", "ms", "gb_per_s", "ratio_vs_reference", "store_pinned"])
    path = harness.append_rows("offload", rows, args.results)
    print(f"rows appended to {path}")
    if device.type == "cuda":
        worst = min(r["ratio_vs_reference"] for r in rows if r["op"] in ("store_per_chunk", "store_batched"))
        print(f"store copies at worst {worst:.2f} x the pinned copy's bandwidth "
              f"(target >= {TARGET_RATIO}: {'met' if worst >= TARGET_RATIO else 'MISSED'})")
        if not args.no_layer_loop:
            loop = layer_loop(device, store, args, copy_stream)
            harness.print_table([loop], ["layers", "tokens", "copy_only_ms", "compute_only_ms", "overlapped_ms",
                                         "copy_gb_per_s", "compute_over_copy", "hidden_fraction"])
            print(f"copy time hidden behind the GEMMs: {loop['hidden_fraction']:.2f} "
                  f"(target >= {TARGET_RATIO}: {'met' if loop['hidden_fraction'] >= TARGET_RATIO else 'MISSED'}"
                  f"{'' if loop['compute_over_copy'] >= 1 else '; compute is shorter than the copies, so it cannot be'})")
            path = harness.append_rows("offload_layer_loop", [loop], args.results)
            print(f"row appended to {path}")
    store.close()


if __name__ == "__main__":
    main()
