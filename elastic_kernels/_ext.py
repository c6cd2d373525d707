"""Lazy loading of the compiled extension ``elastic_kernels._C``.

Importing :mod:`elastic_kernels` never fails because of the extension: the load is tried once,
a failure warns once, and the first call that needs ``_C`` raises :class:`ExtensionUnavailable`
naming the cause and the fix. Loading ``_C`` registers the ``elastic::*`` schemas and their C++
CPU and CUDA kernels with the torch dispatcher.
"""

from __future__ import annotations

import importlib
import os
import warnings

_module = None
_error: str | None = None
_tried = False

_FIX = (
    "build it with `make build` (or `pip install --no-build-isolation -e .` / "
    "`python setup.py build_ext --inplace`) against the installed torch"
)


class ExtensionUnavailable(RuntimeError):
    """The compiled extension elastic_kernels._C could not be loaded."""


def skipped_by_env() -> bool:
    """True when the package was installed with ELASTIC_SKIP_EXT=1 on purpose."""
    return os.environ.get("ELASTIC_SKIP_EXT", "0").strip().lower() in ("1", "true", "yes", "on")


def load():
    """Try to load ``_C`` once; return the module or None (never raises)."""
    global _module, _error, _tried
    if _tried:
        return _module
    _tried = True
    if skipped_by_env():
        _error = "ELASTIC_SKIP_EXT=1 is set, so the extension is neither built nor loaded"
        return None
    try:
        import torch  # noqa: F401 - loads libc10/libtorch, which _C links against

        _module = importlib.import_module("elastic_kernels._C")
    except (ImportError, OSError) as exc:  # missing build, ABI mismatch, missing libcudart...
        _error = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"elastic_kernels._C could not be loaded ({_error}); the pure-torch references "
            f"serve instead. To use the compiled kernels, {_FIX}.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _module


def available() -> bool:
    return load() is not None


def require():
    """Return ``_C`` or raise a message that names the cause and the fix."""
    mod = load()
    if mod is None:
        raise ExtensionUnavailable(f"elastic_kernels._C is not available: {_error}. Fix: {_FIX}.")
    return mod


def cuda_built() -> bool:
    """Whether the loaded extension carries CUDA kernels."""
    mod = load()
    return bool(mod is not None and mod.cuda_built())
