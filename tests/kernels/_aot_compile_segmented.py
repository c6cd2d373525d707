"""Compile the segmented LoRA kernels for a GPU architecture without a GPU, at the meta-parameters
the launchers choose (elastic_kernels/ops/segmented_lora.py: down_meta, up_meta, grad_meta), and
report what ptxas makes of them (registers, spills, shared memory; tests/kernels/_aot_compile.py).

    python tests/kernels/_aot_compile_segmented.py [--arch 90] [--dtypes bf16+fp32 ...] [--ranks 16 64]

TRITON_INTERPRET must be unset. `tests/kernels/test_segmented_lora.py::test_kernels_compile_for_sm90`
runs it for the fp32-adapter case; the figures in [Note: segmented LoRA kernel] come from a
full run (every dtype pair, ranks 16 and 64).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter does not compile kernels")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from elastic_kernels.ops import (
    segmented_lora as sl,  # noqa: E402
    segmented_lora_kernels as sk,  # noqa: E402
)
from tests.kernels import _aot_compile as aot  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAIRS = ("bf16+bf16", "bf16+fp32", "fp32+fp32")  # activations + adapters
I64 = "*i64"


def variants(pair: str, r_max: int):
    a, w = pair.split("+")
    act, adapter = DTYPES[a], DTYPES[w]
    out = []
    for w_is_a in (True, False):
        name = "xa" if w_is_a else "dyb"
        meta = sl.down_meta(act, adapter, r_max, 4096, w_is_a)
        types = {"a_ptr": f"*{a}", "w_ptr": f"*{w}", "w_off_ptr": I64, "rank_ptr": I64, "tile_adapter_ptr": I64,
                 "tile_row_ptr": I64, "seg_end_ptr": I64, "out_ptr": f"*{w}", "L": "i32", "R": "i32",
                 "stride_at": "i32", "stride_ot": "i32"}  # fmt: skip
        out.append((f"down {name} {pair} r{r_max}", sk._seg_down_kernel, types, meta))
        name = "dx" if w_is_a else "delta"
        meta = sl.up_meta(act, adapter, r_max, w_is_a)
        types = {"x_ptr": f"*{w}", "w_ptr": f"*{w}", "w_off_ptr": I64, "rank_ptr": I64, "scale_ptr": "*fp32",
                 "tile_adapter_ptr": I64, "tile_row_ptr": I64, "seg_end_ptr": I64, "out_ptr": f"*{w}", "N": "i32",
                 "stride_xt": "i32", "stride_ot": "i32"}  # fmt: skip
        out.append((f"up {name} {pair} r{r_max}", sk._seg_up_kernel, types, meta))
    for rank_is_m in (True, False):
        ta, tb = (w, a) if rank_is_m else (a, w)  # dA = s dybᵀ lora_x, dB = s dyᵀ xa
        meta = sl.grad_meta(act, adapter, r_max, rank_is_m)
        types = {"a_ptr": f"*{ta}", "b_ptr": f"*{tb}", "out_ptr": f"*{w}", "out_off_ptr": I64, "rank_ptr": I64,
                 "scale_ptr": "*fp32", "seg_start_ptr": I64, "seg_end_ptr": I64, "M": "i32", "P": "i32",
                 "stride_at": "i32", "stride_bt": "i32"}  # fmt: skip
        out.append((f"grad {'dA' if rank_is_m else 'dB'} {pair} r{r_max}", sk._seg_grad_kernel, types, meta))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtypes", nargs="+", default=list(PAIRS), choices=PAIRS)
    p.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for pair in args.dtypes:
        for r_max in args.ranks:
            for name, kernel, types, meta in variants(pair, r_max):
                meta = dict(meta)
                nw, ns = meta.pop("num_warps"), meta.pop("num_stages")
                row = aot._report(name, aot._compile(kernel, types, meta, args.arch, nw, ns), args.arch)
                row.update({k: meta[k] for k in ("BLOCK_M", "BLOCK_R", "BLOCK_P", "BLOCK_T") if k in meta})
                rows.append(row)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(r)


if __name__ == "__main__":
    main()
