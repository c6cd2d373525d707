"""elastic-kernels: LoRA fine-tuning across ranks with frozen base weights as a cache.

The public API (every name below). The library's rooms, each one concern (README's Layout):
config (ElasticPolicy), distributed/, runtime/, host/, nn/, hf/, loading/, planner/ (pure
Python), planning/ (the planner meets a model), finetune/ (the application). Imports flow one
way: finetune -> the rooms -> elastic_kernels -> _C.
"""

from python_api import hf  # noqa: F401 - registers the transformers integration's conversion hook
from python_api.config import ElasticPolicy
from python_api.loading import load_elastic
from python_api.nn import (
    ElasticLinear,
    ElasticLinearFunction,
    ElasticLoRAFunction,
    ElasticLoRALinear,
    LoRAConfig,
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
from python_api.planner import Plan, Profile
from python_api.planning import apply_plan, measure_peak_bytes, measure_profile, plan
from python_api.runtime import ElasticRuntime, ElasticTensor, Phase, Residency, residency_classes

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
    "LoRAConfig",
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
    "elasticize",
    "no_sync",
    "reset_stats",
    "residency_classes",
    "runtime_of",
    "set_pool_budget",
    "stats",
]
