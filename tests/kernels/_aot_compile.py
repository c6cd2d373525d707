"""Compile the paged-linear Triton kernels for a GPU architecture without a GPU, and report
what ptxas makes of them (registers, spills, shared memory) and whether the hot loops use the
instructions they should (wgmma on sm_90, 16-byte cp.async for the operand tiles).

Run as a script (TRITON_INTERPRET must be unset: the interpreter never compiles):

    python tests/kernels/_aot_compile.py [--arch 90] [--json]

`tests/kernels/test_paged_linear.py::test_kernels_compile_for_sm90` runs it in a subprocess. The
numbers quoted in elastic_kernels/ops/paged_linear_kernels.py ([Note: LoRA term as the initial accumulator],
[Note: launch configurations]) come from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter does not compile kernels")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from elastic_kernels.ops import paged_linear as pl  # noqa: E402

# Triton specialises pointer and integer arguments that are multiples of 16 at launch; the
# benchmark shapes (4096 / 11008 features, 2k-16k tokens, r = 16) make every one of them such a
# multiple except rows_per_chunk (e.g. 95 rows of 11008 bf16 = 2 MiB), so that is what is compiled.
NOT_ALIGNED = ("rows_per_chunk",)


def _compile(kernel, types: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    sig = dict(types)
    for name in constexprs:
        sig[name] = "constexpr"
    names = list(sig)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in types
        if types[n] != "fp32" and n not in NOT_ALIGNED
    }
    src = ASTSource(kernel, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def _ptxas_stats(ptx: str, arch: int) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    suffix = "a" if arch >= 90 else ""
    path = f"/tmp/_elastic_aot_{os.getpid()}.ptx"
    with open(path, "w") as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    finally:
        os.unlink(path)
    return {
        "registers": int(re.search(r"Used (\d+) registers", out).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", out).group(1)),
    }


def _report(name, compiled, arch) -> dict:
    ptx = compiled.asm["ptx"]
    row = {"kernel": name, "shared_bytes": compiled.metadata.shared}
    row.update(_ptxas_stats(ptx, arch))
    row["wgmma"] = ptx.count("wgmma.mma_async")
    row["mma_sync"] = ptx.count("mma.sync")
    row["cp_async_16B"] = len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x10", ptx))
    row["cp_async"] = len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx))
    return row


def gemm_types(kind: str, dt: str) -> dict:
    if kind == "fwd":
        ptrs = ["x_ptr", "w_ptr", "page_ptr", "bias_ptr", "xa_ptr", "b_ptr", "y_ptr"]
        ints = ["T", "N", "K", "R", "rows_per_chunk", "stride_xt", "stride_xat", "stride_yt"]
    else:
        ptrs = ["dy_ptr", "w_ptr", "page_ptr", "dyb_ptr", "a_ptr", "dx_ptr"]
        ints = ["T", "N", "K", "R", "rows_per_chunk", "stride_dyt", "stride_dybt", "stride_dxt"]
    types = {p: ("*i64" if p == "page_ptr" else f"*{dt}") for p in ptrs}
    types.update({i: "i32" for i in ints})
    types["scale"] = "fp32"
    types["T_BUCKET"] = "i32"
    return types


def variants(arch: int):
    """(name, kernel, types, constexprs, num_warps, num_stages) of the variants that matter."""
    out = []
    for kind, kernel, configs in (("fwd", pl._paged_linear_fwd_kernel, pl._GEMM_CONFIGS),
                                  ("dgrad", pl._paged_linear_dgrad_kernel, pl._DGRAD_CONFIGS)):  # fmt: skip
        for cfg in configs:
            for lora in (False, True):
                meta = dict(cfg.kwargs, BLOCK_K=64, BLOCK_R=16, W_ALIGN=8, DOT_PRECISION="tf32", UPCAST_DOT=False,
                            HAS_LORA=lora, EVEN_R=True)  # fmt: skip
                if kind == "fwd":
                    meta.update(HAS_BIAS=lora, EVEN_K=True)
                else:
                    meta.update(EVEN_N=True, EVEN_OUT=True)
                name = f"{kind} bf16 {cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages} " \
                       f"{'lora+bias' if kind == 'fwd' and lora else 'lora' if lora else 'plain'}"  # fmt: skip
                out.append((name, kernel, gemm_types(kind, "bf16"), meta, cfg.num_warps, cfg.num_stages))
    # The ragged, unaligned, small-problem and fp32 paths (every EVEN_* flag off).
    small = dict(pl._SMALL_GEMM)
    nw, ns = small.pop("num_warps"), small.pop("num_stages")
    for dt, prec, bk in (("fp32", "ieee", 32), ("fp16", "tf32", 64)):
        meta = dict(small, BLOCK_K=bk, BLOCK_R=16, W_ALIGN=1, DOT_PRECISION=prec, UPCAST_DOT=False, HAS_LORA=True,
                    EVEN_R=False, HAS_BIAS=True, EVEN_K=False)  # fmt: skip
        out.append((f"fwd {dt} 64x64 ragged", pl._paged_linear_fwd_kernel, gemm_types("fwd", dt), meta, nw, ns))
        meta = dict(small, BLOCK_K=bk, BLOCK_R=16, W_ALIGN=1, DOT_PRECISION=prec, UPCAST_DOT=False, HAS_LORA=True,
                    EVEN_R=False, EVEN_N=False, EVEN_OUT=False)  # fmt: skip
        out.append((f"dgrad {dt} 64x64 ragged", pl._paged_linear_dgrad_kernel, gemm_types("dgrad", dt), meta, nw, ns))
    down_types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "L": "i32", "R": "i32",
                  "stride_at": "i32", "stride_bl": "i32", "stride_bj": "i32", "stride_ot": "i32"}  # fmt: skip
    for even in (True, False):
        meta = dict(EVEN_L=even, EVEN_R=even, DOT_PRECISION="tf32", UPCAST_DOT=False, BLOCK_M=64, BLOCK_L=128, BLOCK_R=16)
        out.append((f"lora_down bf16 even={even}", pl._lora_down_kernel, down_types, meta, 4, 3))
    grad_types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "T": "i32", "M": "i32", "P": "i32",
                  "stride_at": "i32", "stride_bt": "i32", "tokens_per_split": "i32", "scale": "fp32"}  # fmt: skip
    for bm, bp in ((16, 128), (128, 16)):
        meta = dict(DOT_PRECISION="tf32", UPCAST_DOT=False, BLOCK_M=bm, BLOCK_P=bp, BLOCK_T=64)
        out.append((f"lora_grad bf16 {bm}x{bp}", pl._lora_grad_kernel, grad_types, meta, 4, 3))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200) or 80 (A100)")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = ap.parse_args(argv)
    rows = []
    for name, kernel, types, meta, nw, ns in variants(args.arch):
        rows.append(_report(name, _compile(kernel, types, meta, args.arch, nw, ns), args.arch))
    if args.json:
        print(json.dumps(rows))
    else:
        cols = list(rows[0])
        print("  ".join(cols))
        for r in rows:
            print("  ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
