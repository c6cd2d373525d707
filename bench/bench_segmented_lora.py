"""The segmented multi-LoRA op (issue 29) against a loop over the adapters.

    python bench/bench_segmented_lora.py --device cuda    # Triton kernels (under `make gpu-check`)
    python bench/bench_segmented_lora.py --device cpu     # the dry path: reference, small shapes

One step is the LoRA part of a layer for K adapters on their own rows (T rows in all, split
evenly, rank r each): forward (xa, delta) and backward (dx, dA, dB) given dy. In the same run:
- ``segmented``: elastic_kernels' segmented_lora_fwd + segmented_lora_bwd (impl="auto": the
  Triton kernels on CUDA, one launch per product over every adapter; the grouped reference on CPU);
- ``kloop``: K PEFT-style LoRA branches, one per adapter on its rows, ``F.linear(F.linear(x_k,
  A_k), B_k) * s_k`` with autograd (what K separate PEFT LoRA layers launch).
Activations in --dtype (bf16 on CUDA), adapters fp32 (PEFT's autocast_adapter_dtype, the
library's default). FLOPs counted: 6·T·r·(in + out) per step (down, up and their gradients).
Rows to bench/results/segmented_lora.csv. On CPU both run the same per-adapter GEMMs, so the
ratio says nothing about the kernels; the CPU run exists to check that the script works.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

SHAPES = {  # (T, in, out)
    "cuda": [(4096, 4096, 4096), (16384, 4096, 4096), (16384, 4096, 11008)],
    "cpu": [(256, 256, 256)],
}
ADAPTERS = {"cuda": (1, 4, 8), "cpu": (1, 4)}


def _problem(t, k_in, n, num_adapters, r, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    step = t // num_adapters
    offs = [min(t, i * step) for i in range(num_adapters)] + [t]
    x = torch.randn(t, k_in, generator=gen).to(device, dtype)
    dy = torch.randn(t, n, generator=gen).to(device, dtype)
    a = [(torch.randn(r, k_in, generator=gen) * k_in**-0.5).to(device) for _ in range(num_adapters)]
    b = [(torch.randn(n, r, generator=gen) * 0.01).to(device) for _ in range(num_adapters)]
    scales = [2.0] * num_adapters
    return offs, x, dy, a, b, scales


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="activations; default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)

    from elastic_kernels.ops import segmented_lora_bwd, segmented_lora_fwd

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    ctx = harness.context(device)
    rows = []
    for t, k_in, n in SHAPES[device.type]:
        for num_adapters in ADAPTERS[device.type]:
            offs, x, dy, a, b, scales = _problem(t, k_in, n, num_adapters, args.r, device, dtype)

            def segmented():
                delta, xa = segmented_lora_fwd(x, offs, a, b, scales)
                return segmented_lora_bwd(dy, x, xa, offs, a, b, scales)

            leaves_a = [w.clone().requires_grad_() for w in a]
            leaves_b = [w.clone().requires_grad_() for w in b]
            xl = x.detach().requires_grad_()

            def kloop():
                for w in leaves_a + leaves_b + [xl]:
                    w.grad = None
                outs = []
                for k in range(num_adapters):
                    lo, hi = offs[k], offs[k + 1]
                    xk = xl[lo:hi].to(torch.float32)  # PEFT casts x to the adapters' dtype
                    outs.append((F.linear(F.linear(xk, leaves_a[k]), leaves_b[k]) * scales[k], lo, hi))
                torch.autograd.backward([o for o, _, _ in outs], [dy[lo:hi].to(torch.float32) for _, lo, hi in outs])

            timings = {"kloop": harness.measure(kloop, device, repeats=repeats),
                       "segmented": harness.measure(segmented, device, repeats=repeats)}
            flops = 6 * t * args.r * (k_in + n)
            for impl, sec in timings.items():
                rows.append({
                    **ctx, "dtype": str(dtype).replace("torch.", ""), "tokens": t, "in": k_in, "out": n, "r": args.r,
                    "adapters": num_adapters, "impl": impl, "ms": round(sec * 1e3, 3),
                    "tflops": round(flops / sec / 1e12, 4), "vs_kloop": round(timings["kloop"] / sec, 3),
                })
    harness.print_table(rows, ["tokens", "in", "out", "adapters", "impl", "ms", "tflops", "vs_kloop"])
    print("rows appended to", harness.append_rows("segmented_lora", rows, args.results))


if __name__ == "__main__":
    main()
