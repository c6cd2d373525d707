"""The one place every skip reason comes from.

Skips exist for exactly two situations: no CUDA device (GPU tests), and an install made on
purpose without the extension (ELASTIC_SKIP_EXT=1). A failure to load the extension when it
was meant to be built is an error, never a skip.
"""

from __future__ import annotations

import glob
import os

import pytest


def gpu_present() -> bool:
    """A CUDA device is visible, judged without initialising CUDA (collection-time safe)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def gpu_skip_reason() -> str | None:
    if not gpu_present():
        return "no CUDA device visible on this machine (GPU tests run under `make gpu-check`)"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use the visible GPU (CPU-only build or driver mismatch)"
    return None


def ext_skip_reason() -> str | None:
    """For tests marked `needs_ext` (the elastic runtime at world size >= 2 needs the C++
    PagePool): a reason only when the extension was left out on purpose."""
    from elastic_kernels import _ext

    if _ext.skipped_by_env():
        return "ELASTIC_SKIP_EXT=1: the elastic runtime's PagePool is C++ and was not built on purpose"
    return None


def require_ext():
    """Return elastic_kernels._C; skip only when ELASTIC_SKIP_EXT=1 says it was left out on purpose."""
    from elastic_kernels import _ext

    if _ext.skipped_by_env():
        pytest.skip("ELASTIC_SKIP_EXT=1: the compiled extension was not built on purpose")
    return _ext.require()  # raises ExtensionUnavailable (a failure) if it should be there


def require_cuda_ext():
    """The extension with its CUDA kernels, on a machine with a GPU (GPU tests only)."""
    mod = require_ext()
    if not mod.cuda_built():
        raise AssertionError("a GPU is visible but elastic_kernels._C was built without CUDA")
    return mod


def require_triton_on_cpu():
    """Triton kernels on CPU tensors run only under the interpreter, which conftest turns on
    exactly on machines without a GPU; where a GPU is visible the GPU tests cover Triton."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1, which is set only on "
                    "machines without a GPU (the gpu-marked tests cover Triton there)")
