"""elastic-kernels: LoRA fine-tuning across ranks with frozen base weights as a cache.

The public API (every name below). The library's rooms, each one concern (docs/architecture.md, Layers):
config (ElasticPolicy), distributed/, runtime/, host/, nn/, hf/, loading/, planner/ (pure
Python), planning/ (the planner meets a model), finetune/ (the application). Imports flow one
way: finetune -> the rooms -> elastic_kernels -> _C.

The folder python_api/ is installed as the import package `elastic_kernels.api` (setup.py's
package_dir); inside it every import of the library is relative, so the code does not depend
on the name it is mounted under. Imported as a top-level `python_api` (from the repository
root without installing) it would be a second copy of every module, with its own runtime
classes: refused.
"""

if __name__ != "elastic_kernels.api":
    raise ImportError(
        f"the library's folder python_api/ was imported as {__name__!r}; import it as elastic_kernels.api "
        f"(install the project: pip install --no-build-isolation -e .)"
    )

from . import hf  # noqa: F401 - registers the transformers integration's conversion hook
from .config import ElasticPolicy
from .distributed.zero import ShardedOptimizer
from .loading import load_elastic
from .nn import (
    ElasticLinear,
    ElasticLinearFunction,
    ElasticLoRAFunction,
    ElasticLoRALinear,
    ElasticMultiLoRALinear,
    LoRAConfig,
    adapter_parameters,
    convert_to_elastic,
    elasticize,
    load_adapter,
    merge_adapters,
    no_sync,
    reset_stats,
    runtime_of,
    save_adapter,
    set_pool_budget,
    stats,
)
from .planner import Plan, Profile
from .planning import apply_plan, measure_peak_bytes, measure_profile, plan
from .runtime import ElasticRuntime, ElasticTensor, Phase, Residency, residency_classes

__all__ = [
    "Plan",
    "Profile",
    "apply_plan",
    "load_elastic",
    "measure_peak_bytes",
    "measure_profile",
    "plan",
    "ElasticLoRAFunction",
    "ElasticLoRALinear",
    "ElasticMultiLoRALinear",
    "LoRAConfig",
    "adapter_parameters",
    "convert_to_elastic",
    "load_adapter",
    "merge_adapters",
    "save_adapter",
    "ElasticLinear",
    "ElasticLinearFunction",
    "ElasticPolicy",
    "ElasticRuntime",
    "ElasticTensor",
    "Phase",
    "Residency",
    "ShardedOptimizer",
    "elasticize",
    "no_sync",
    "reset_stats",
    "residency_classes",
    "runtime_of",
    "set_pool_budget",
    "stats",
]
