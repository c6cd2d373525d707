"""The one place every skip reason comes from.

Skips exist for exactly two situations: no CUDA device (GPU tests), and an install made on
purpose without the extension (ELASTIC_SKIP_EXT=1) or without its CUDA part (ELASTIC_SKIP_CUDA=1,
for the tests of the CUDA kernels). A failure to load the extension when it
was meant to be built is an error, never a skip.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import subprocess
import sys

import pytest

_PROBE = "import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.version.cuda or torch.version.hip)"


@functools.cache
def _torch_uses_a_gpu() -> tuple[bool, str]:
    """(torch.cuda.is_available(), what torch is), asked in a child process: this process never
    initialises the CUDA driver (cuInit), so collection stays cheap and forked tests safe."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the torch probe failed to run ({exc})"
    if out.returncode != 0:
        return False, f"the torch probe failed: {out.stderr.strip()[-300:]}"
    available, version, backend = out.stdout.split()
    return available == "1", f"torch {version} ({'CPU-only build' if backend == 'None' else backend})"


def _gpu_driver_present() -> bool:
    """Something a GPU could be reached through without an /dev/nvidia<N> node: the CUDA driver
    library (WSL, renamed device nodes) or ROCm's /dev/kfd."""
    if os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")  # loading the library does not initialise the driver
    except OSError:
        return False
    return True


def gpu_present() -> bool:
    """A CUDA (or ROCm) device is visible, judged without initialising CUDA in this process
    (collection-time safe): the NVIDIA device nodes; where there are none but a GPU driver is
    there, torch.cuda.is_available() asked in a child process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    return _gpu_driver_present() and _torch_uses_a_gpu()[0]


def gpu_skip_reason() -> str | None:
    if not gpu_present():
        return "no CUDA device visible on this machine (GPU tests run under `make gpu-check`)"
    usable, what = _torch_uses_a_gpu()
    if not usable:
        return f"{what} cannot use the visible GPU (CPU-only build or driver mismatch)"
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
    """The extension with its CUDA kernels, on a machine with a GPU (GPU tests only); skipped
    only when ELASTIC_SKIP_CUDA=1 says the CUDA part was left out on purpose (`make gpu-check`
    on a machine without nvcc: docs/gpu.md)."""
    mod = require_ext()
    if not mod.cuda_built() and os.environ.get("ELASTIC_SKIP_CUDA", "0").strip().lower() in ("1", "true", "yes", "on"):
        pytest.skip("ELASTIC_SKIP_CUDA=1: the extension's CUDA kernels were not built on purpose (no nvcc)")
    if not mod.cuda_built():
        raise AssertionError("a GPU is visible but elastic_kernels._C was built without CUDA")
    return mod


def require_triton_on_cpu():
    """Triton kernels on CPU tensors run only under the interpreter, which conftest turns on
    exactly on machines without a GPU; where a GPU is visible the GPU tests cover Triton."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1, which is set only on "
                    "machines without a GPU (the gpu-marked tests cover Triton there)")
