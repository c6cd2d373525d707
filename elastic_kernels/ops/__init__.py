"""The ops of the ``elastic`` namespace, one family per module, each with its pure-torch
reference beside it, its Triton kernels and its fake impls:

  _checks.py                 argument checks shared by every Python impl (a leaf)
  pack.py                    pack_shards / unpack_gathered: dispatch, fakes of the C++ schemas
  pack_reference.py          their pure-torch references
  pack_triton.py             their Triton impls (elastic::*_triton)
  paged_linear.py            paged LoRA linear: launchers, triton_op registration, dispatch
  paged_linear_kernels.py    its @triton.jit kernels
  paged_linear_reference.py  its pure-torch reference and [Note: numerics of the paged LoRA ops]
  dequant.py                 dequant_chunks(_into) of quantized chunk blobs: Triton launchers,
                             triton_op registration, dispatch, fakes of the C++ schemas
  dequant_kernels.py         its @triton.jit kernels
  dequant_reference.py       its pure-torch reference
  segmented_lora.py          segmented multi-LoRA (K adapters over row segments): launchers,
                             triton_op registration, dispatch, [Note: segmented LoRA kernel]
  segmented_lora_kernels.py  its @triton.jit kernels
  segmented_lora_reference.py  its pure-torch reference, grouped per adapter
  _lazy.py                   LazyOps: the Triton ops register on first need, not at import
                             ([Note: Triton ops register lazily])
"""

from elastic_kernels.ops.dequant import dequantize
from elastic_kernels.ops.pack import pack_shards, unpack_gathered
from elastic_kernels.ops.paged_linear import lora_adapter_grads, paged_lora_linear_dgrad, paged_lora_linear_fwd
from elastic_kernels.ops.segmented_lora import segmented_lora_bwd, segmented_lora_fwd


def register_triton_ops() -> None:
    """Register every family's Triton ops now ([Note: Triton ops register lazily] in _lazy.py):
    what listing the ``elastic::`` namespace, or reaching ``torch.ops.elastic.*_triton`` and the
    paged / segmented LoRA ops directly, needs. Idempotent; imports torch._inductor."""
    from elastic_kernels.ops import dequant, pack_triton, paged_linear, segmented_lora

    for family in (pack_triton, paged_linear, dequant, segmented_lora):
        family.register_ops()


__all__ = [
    "dequantize",
    "lora_adapter_grads",
    "pack_shards",
    "register_triton_ops",
    "paged_lora_linear_dgrad",
    "paged_lora_linear_fwd",
    "segmented_lora_bwd",
    "segmented_lora_fwd",
    "unpack_gathered",
]
