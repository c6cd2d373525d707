"""The errors the CLI reports as one line (see [Note: failures during the run] in __init__.py)."""

from __future__ import annotations

import errno


class FinetuneError(ValueError):
    """Bad input or an unusable setting: reported as one line, before any training step (or,
    for a failure during the run, on every rank at the same point)."""


class OutputError(FinetuneError):
    """An output file could not be written (disk full, read-only, removed folder)."""

    def __init__(self, path: str, exc: BaseException):
        reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
        code = getattr(exc, "errno", None)
        super().__init__(f"cannot write {path}: {reason}" + (f" ({errno.errorcode.get(code, code)})" if code else ""))
        self.path = path
