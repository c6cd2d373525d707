"""No op of the `elastic` namespace escapes: each has a pure-torch reference, a fake (meta)
impl and opcheck samples in the test module of its family, and the ops that must carry a CUDA
kernel do where the CUDA part is built."""

import importlib
import pkgutil

import torch

import elastic_kernels
from elastic_kernels.ops import paged_linear_reference
from tests.kernels import test_pack_ops, test_paged_linear, test_quant, test_segmented_lora


def _covered() -> dict:
    """op name -> its pure-torch reference, for every op some test module opchecks."""
    covered = {name: entry["reference"] for name, entry in test_pack_ops.OP_TESTS.items()}
    covered.update({name: entry["reference"] for name, entry in test_quant.OP_TESTS.items()})
    for op, _ in test_segmented_lora._opcheck_samples().values():
        name = op._schema.name.split("::")[1]
        covered[name] = test_segmented_lora.OP_REFERENCES[name]
    for op, _ in test_paged_linear._opcheck_samples().values():
        name = op._schema.name.split("::")[1]
        covered[name] = getattr(paged_linear_reference, f"{name}_reference")
    return covered


def test_every_elastic_op_is_covered():
    from torch._library.simple_registry import singleton

    for mod in pkgutil.walk_packages(elastic_kernels.__path__, "elastic_kernels."):
        if mod.name != "elastic_kernels._C":
            importlib.import_module(mod.name)  # ops registered at import time show up too
    registered = elastic_kernels.registered_ops()
    assert {"pack_shards_triton", "unpack_gathered_triton", "paged_lora_linear_fwd", "dequant_chunks_triton",
            "dequant_chunks_into_triton"} <= set(registered)
    covered = _covered()
    missing = sorted(set(registered) - set(covered))
    assert not missing, f"elastic:: ops without a reference and opcheck samples in a test module: {missing}"
    for name in registered:
        assert callable(covered[name]), name
        assert singleton.find(f"elastic::{name}").fake_impl.kernel is not None, f"elastic::{name} has no fake impl"
    from elastic_kernels import _ext

    if _ext.available():
        assert {"pack_shards", "unpack_gathered", "dequant_chunks", "dequant_chunks_into"} <= set(registered)
        if _ext.cuda_built():
            for name in elastic_kernels.CUDA_OPS:
                assert torch._C._dispatch_has_kernel_for_dispatch_key(f"elastic::{name}", "CUDA"), name
