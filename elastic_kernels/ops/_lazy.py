"""Lazy registration of the ``triton_op`` ops of a family (a leaf: imports only torch).

[Note: Triton ops register lazily]
Registering a ``torch.library.triton_op`` scans the decorated function's source for the
kernels it launches (``torch._library.triton.find_triton_kernels``), which imports
``torch._inductor.utils`` and with it ``torch._inductor`` and ``torch._dynamo``: 3.8 s of the
11.8 s import of ``elastic_kernels`` on the shared 2-core dev VM (load average 7,
2026-12-03, ``python -X importtime -c 'import elastic_kernels.api.finetune.cli'``), while a
CPU job never launches a Triton kernel. So each family registers its ops on the first dispatch
to a Triton path (CUDA tensors, or the interpreter with ``impl="triton"``): the dispatch
wrapper calls ``get(name)``, which registers once under a lock, binds the ops as module
globals and returns one. The module's ``__getattr__`` does the same on the first access to
one of them (``paged_linear.OPS``, a test's monkeypatch), and
``elastic_kernels.ops.register_triton_ops()`` registers every family (what
``elastic_kernels.registered_ops()`` and the tests that reach ``torch.ops.elastic.*`` call).
Names, schemas, FunctionalTensorMode rules and behaviour are those of a registration at import.
A torch.compile trace that reaches a dispatch wrapper before any registration runs the
registration eagerly (``_register_once`` is ``torch._disable_dynamo``'d: one graph break, once).
What it saves: ``import elastic_kernels`` and CPU work with its ops no longer load the
compiler. It does not save a fine-tuning process that: the library's layers are
``torch.compiler.disable``d (python_api/nn, imports torch._dynamo at class definition),
python_api/pipeline imports torch.distributed.pipelining (imports torch._dynamo), and
transformers 5.23 imports torch._dynamo itself with any model (``masking_utils`` imports
``torch._dynamo._trace_wrapped_higher_order_op``; ``LlamaConfig`` already pulls it in through
``torch.compiler.disable`` in ``generation/continuous_batching``), so a CLI worker loads the
compiler anyway (bench/results/2026-12-03_import_cost.md).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch


class LazyOps:
    """The ops of one family (module ``module``), registered by ``register()`` on first need.

    ``register`` returns ``{name: value}`` for exactly ``names``, bound as module globals."""

    def __init__(self, module: str, names: tuple[str, ...], register: Callable[[], dict]):
        self.module = module
        self.names = names
        self._register = register
        self._lock = threading.Lock()
        self.registered = False

    def ensure(self) -> None:
        """Register the ops unless done (cheap after the first call)."""
        if not self.registered:
            self._register_once()

    @torch._disable_dynamo
    def _register_once(self) -> None:
        with self._lock:
            if self.registered:
                return
            attrs = self._register()
            if set(attrs) != set(self.names):
                raise AssertionError(f"{self.module}: registered {sorted(attrs)}, expected {sorted(self.names)}")
            vars(sys.modules[self.module]).update(attrs)
            self.registered = True  # after the globals: a reader that sees True finds them

    def get(self, name: str):
        """The module global ``name``, one of ``names`` (registering them first), else
        AttributeError: the module's ``__getattr__``, and how its dispatch wrappers reach an op
        (so a test's monkeypatch of the module attribute is what they call)."""
        if name not in self.names:
            raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
        self.ensure()
        return vars(sys.modules[self.module])[name]
