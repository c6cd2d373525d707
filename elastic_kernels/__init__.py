"""elastic-kernels ops layer: mechanism, no policy.

The compiled extension ``_C`` (schemas, C++ CPU and CUDA kernels, the page pool) loads lazily:
importing this package never fails because of it (see ``_ext``). Every op has a pure-torch
reference here that serves where the extension is absent.
"""

from elastic_kernels import _ext

_ext.load()

from elastic_kernels.layout import ChunkLayout  # noqa: E402
from elastic_kernels.ops import pack_shards, unpack_gathered  # noqa: E402 - after _ext.load(): registers fakes

# Ops of the `elastic` namespace that must carry a CUDA kernel when the CUDA part is built.
CUDA_OPS = ("pack_shards", "unpack_gathered")


def registered_ops():
    """Names (without namespace) of every op registered under `elastic::` right now."""
    import torch

    names = torch._C._dispatch_get_all_op_names()
    return sorted({n.split("::", 1)[1].split(".")[0] for n in names if n.startswith("elastic::")})


__all__ = ["CUDA_OPS", "ChunkLayout", "pack_shards", "registered_ops", "unpack_gathered"]
