"""The Triton ops register on first need, not at import ([Note: Triton ops register lazily] in
elastic_kernels/ops/_lazy.py): importing the mechanism layer and running its ops on CPU never
imports torch._inductor or torch._dynamo; the first dispatch to a Triton path registers the
family's ops (once, also under concurrent first calls) and they compute what the reference does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from elastic_kernels.ops._lazy import LazyOps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a fresh interpreter (the test process has long imported the compiler). Prints one JSON
# line: the compiler modules loaded and the ops registered after each stage.
_SCRIPT = r"""
import json, sys
import torch

def state():
    names = torch._C._dispatch_get_all_op_names()
    return {"compiler": sorted(m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules),
            "triton_ops": sorted(n.split("::")[1] for n in names
                                 if n in ("elastic::paged_lora_linear_fwd", "elastic::segmented_lora_fwd",
                                          "elastic::dequant_chunks_triton", "elastic::pack_shards_triton"))}

out = {}
import elastic_kernels
from elastic_kernels import ChunkLayout, dequantize, pack_shards, paged_lora_linear_dgrad, paged_lora_linear_fwd
from elastic_kernels import lora_adapter_grads, segmented_lora_bwd, segmented_lora_fwd, unpack_gathered
from elastic_kernels.ops import paged_linear_reference as ref
from elastic_kernels.quant import NF4ChunkFormat
from elastic_kernels.quant.nf4 import quantize_nf4
out["import"] = state()

g = torch.Generator().manual_seed(0)
x, w = torch.randn(5, 16, generator=g), torch.randn(12, 16, generator=g)
a, b = torch.randn(4, 16, generator=g), torch.randn(12, 4, generator=g)
chunks = list(w.split(4))
y, xa = paged_lora_linear_fwd(x, chunks, None, None, a, b, 0.5)
dx, dyb = paged_lora_linear_dgrad(torch.ones_like(y), chunks, a, b, 0.5)
lora_adapter_grads(x, xa, torch.ones_like(y), dyb, 0.5)
segmented_lora_bwd(torch.ones_like(y), x, segmented_lora_fwd(x, [0, 2, 5], [a, a], [b, b], [0.5, 1.0])[1], [0, 2, 5],
                   [a, a], [b, b], [0.5, 1.0])
layout = ChunkLayout.for_weight(w.shape, 4, 2)
send = pack_shards([layout.shard(w, 0)], [layout.slice_numel], [0], [layout.num_chunks])
dests = [torch.empty(layout.chunk_numel_of(c)) for c in range(layout.num_chunks)]
unpack_gathered(torch.cat([send, pack_shards([layout.shard(w, 1)], [layout.slice_numel], [0], [layout.num_chunks])]),
                2, [layout.slice_numel], [layout.num_chunks], dests)
assert torch.equal(torch.cat(dests), w.reshape(-1))
dequantize([quantize_nf4(torch.randn(2, 64, generator=g))], NF4ChunkFormat(2, 64, 64, False), dtype=torch.float32)
out["cpu_ops"] = state()

# The first dispatch to a Triton path (the interpreter: TRITON_INTERPRET=1) registers the family.
y_t, xa_t = paged_lora_linear_fwd(x, chunks, None, None, a, b, 0.5, impl="triton")
y_r, xa_r = ref.paged_lora_linear_fwd_reference(x, chunks, None, None, a, b, 0.5)
out["triton_fwd"] = state()
out["max_err"] = max((y_t - y_r).abs().max().item(), (xa_t - xa_r).abs().max().item())
out["scale"] = y_r.abs().max().item()
elastic_kernels.registered_ops()
out["listed"] = state()
print(json.dumps(out))
"""


def test_cpu_ops_never_import_the_compiler_and_the_first_triton_call_registers():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)  # the child's environment only
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import"] == {"compiler": [], "triton_ops": []}, out["import"]
    assert out["cpu_ops"] == {"compiler": [], "triton_ops": []}, out["cpu_ops"]
    # Only the paged family registered, and registering it imported the compiler (what the
    # deferral saves a process that never gets here).
    assert out["triton_fwd"]["triton_ops"] == ["paged_lora_linear_fwd"], out["triton_fwd"]
    assert "torch._inductor" in out["triton_fwd"]["compiler"], out["triton_fwd"]
    assert out["max_err"] <= 1e-5 * out["scale"], out
    assert out["listed"]["triton_ops"] == ["dequant_chunks_triton", "pack_shards_triton", "paged_lora_linear_fwd",
                                           "segmented_lora_fwd"], out["listed"]


def test_concurrent_first_calls_register_once():
    calls = []
    gate = threading.Barrier(8)

    def register():
        calls.append(threading.get_ident())
        return {"op_a": object(), "OPS": ()}

    lazy = LazyOps(__name__, ("op_a", "OPS"), register)
    seen = []

    def first_call():
        gate.wait()
        seen.append(lazy.get("op_a"))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(seen) == 8 and all(s is seen[0] for s in seen)
    assert globals()["op_a"] is seen[0]
    del globals()["op_a"], globals()["OPS"]


def test_a_name_outside_the_family_is_an_attribute_error():
    lazy = LazyOps(__name__, ("op_b",), lambda: {"op_b": 1})
    try:
        lazy.get("op_c")
    except AttributeError as exc:
        assert "op_c" in str(exc)
    else:
        raise AssertionError("LazyOps.get('op_c') did not raise")
    assert not lazy.registered
