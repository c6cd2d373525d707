"""elastic-kernels ops layer: mechanism, no policy.

The compiled extension ``_C`` (schemas, C++ CPU and CUDA kernels, the page pool) loads lazily:
importing this package never fails because of it (see ``_ext``). Every op has a pure-torch
reference here that serves where the extension is absent.
"""

from elastic_kernels import _ext

_ext.load()

from elastic_kernels.host_store import HostStore, HostStoreError  # noqa: E402 - shared host segment (csrc/host/)
from elastic_kernels.layout import ChunkLayout  # noqa: E402

# The ops (elastic_kernels/ops/): the pack ops' fakes register after _ext.load(); the Triton
# ops register on first need ([Note: Triton ops register lazily]); impl="auto" picks per device.
from elastic_kernels.ops import (  # noqa: E402
    dequantize,
    lora_adapter_grads,
    pack_shards,
    paged_lora_linear_dgrad,
    paged_lora_linear_fwd,
    segmented_lora_bwd,
    segmented_lora_fwd,
    unpack_gathered,
)
from elastic_kernels.pool import PagePool, PoolExhausted  # noqa: E402 - after the _C load attempt

# Ops of the `elastic` namespace that must carry a CUDA kernel when the CUDA part is built.
CUDA_OPS = ("pack_shards", "unpack_gathered")


def registered_ops():
    """Names (without namespace) of every op of the `elastic::` namespace: the Triton ops are
    registered first (they register lazily: elastic_kernels/ops/_lazy.py)."""
    import torch

    from elastic_kernels.ops import register_triton_ops

    register_triton_ops()

    names = torch._C._dispatch_get_all_op_names()
    return sorted({n.split("::", 1)[1].split(".")[0] for n in names if n.startswith("elastic::")})


__all__ = [
    "CUDA_OPS",
    "ChunkLayout",
    "HostStore",
    "HostStoreError",
    "PagePool",
    "PoolExhausted",
    "dequantize",
    "lora_adapter_grads",
    "pack_shards",
    "paged_lora_linear_dgrad",
    "paged_lora_linear_fwd",
    "registered_ops",
    "segmented_lora_bwd",
    "segmented_lora_fwd",
    "unpack_gathered",
]
