"""ElasticLoRALinear forward+backward against PEFT's LoRA linear and a plain nn.Linear.

    python bench/bench_lora_linear.py --device cpu            # reference path, small shapes
    python bench/bench_lora_linear.py --device cuda           # Triton kernels, bf16, big shapes

One layer, world size 1 (a one-rank gloo group: no communication, the weight's chunks are
views of its shard), adapters of rank r; each step is y = layer(x); y.backward(dy) with x
requiring grad (so dgrad runs, as in every layer but the first of a network). In the same
run: a plain frozen nn.Linear (no adapters), PEFT's LoRA Linear (peft.get_peft_model), and a
dense `x @ W.T` GEMM as the ceiling. FLOPs counted: forward 2·T·K·N, dgrad 2·T·K·N, LoRA
6·T·r·(K+N) (down, up and their gradients). Rows to bench/results/lora_linear.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

SHAPES = {
    "cuda": [(t, k, n) for t in (2048, 8192, 16384) for k, n in ((4096, 4096), (4096, 11008), (11008, 4096))],
    "cpu": [(256, 1024, 1024), (256, 1024, 2816), (256, 2816, 1024)],
}


def _peft_layer(linear, r, alpha):
    from peft import LoraConfig, get_peft_model

    holder = nn.Sequential()
    holder.add_module("proj", linear)
    model = get_peft_model(holder, LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], lora_dropout=0.0))
    with torch.no_grad():  # B = 0 would let a clever kernel skip work; make the term real
        model.base_model.model.proj.lora_B["default"].weight.normal_(0, 0.01)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--chunk-mib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)

    from elastic_kernels.api import ElasticLoRALinear, ElasticPolicy, LoRAConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    repeats = args.repeats or (20 if device.type == "cuda" else 7)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            rows = _run(args, device, dtype, repeats, ElasticLoRALinear, ElasticPolicy, LoRAConfig)
        finally:
            dist.destroy_process_group()
    harness.print_table(rows, ["tokens", "in", "out", "impl", "ms", "tflops", "vs_peft", "vs_dense_ceiling"])
    print("rows appended to", harness.append_rows("lora_linear", rows, args.results))


def _run(args, device, dtype, repeats, ElasticLoRALinear, ElasticPolicy, LoRAConfig):
    ctx = harness.context(device)
    rows = []
    torch.manual_seed(0)
    for tokens, k, n in SHAPES[device.type]:
        linear = nn.Linear(k, n, bias=False, device=device, dtype=dtype).requires_grad_(False)
        x = torch.randn(tokens, k, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, n, device=device, dtype=dtype)
        lora = LoRAConfig(r=args.r, alpha=2 * args.r)
        policy = ElasticPolicy(chunk_bytes=int(args.chunk_mib * 2**20))
        elastic = ElasticLoRALinear.from_linear(nn.Linear(k, n, bias=False, device=device, dtype=dtype).requires_grad_(False),
                                                lora, policy, name="proj")
        with torch.no_grad():
            elastic.lora_B.weight.normal_(0, 0.01)
        peft = _peft_layer(linear, args.r, 2 * args.r)
        w = linear.weight.detach()

        def step(fn):
            def run():
                x.grad = None
                fn(x).backward(dy)
            return run

        dense = lambda: x.detach() @ w.t()  # noqa: E731 - the ceiling: one contiguous GEMM
        t_dense = harness.measure(dense, device, repeats=repeats)
        timings = {
            "plain": harness.measure(step(lambda t: nn.functional.linear(t, w)), device, repeats=repeats),
            "peft": harness.measure(step(peft), device, repeats=repeats),
            "elastic": harness.measure(step(elastic), device, repeats=repeats),
        }
        dense_tflops = 2 * tokens * k * n / t_dense / 1e12
        for impl, t in timings.items():
            flops = 4 * tokens * k * n + (0 if impl == "plain" else 6 * tokens * args.r * (k + n))
            rows.append({
                **ctx, "dtype": str(dtype).replace("torch.", ""), "tokens": tokens, "in": k, "out": n, "r": args.r,
                "impl": impl, "ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 3),
                "vs_peft": round(timings["peft"] / t, 3), "dense_ceiling_tflops": round(dense_tflops, 3),
                "vs_dense_ceiling": round(flops / t / 1e12 / dense_tflops, 3),
            })
        elastic = peft = linear = x = dy = None  # freed before the next shape (step() closes over x, dy)
    return rows


if __name__ == "__main__":
    main()
