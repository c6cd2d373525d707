"""Policy and user API of elastic-kernels (config, elastic runtime, LoRA layers, CLI).

Imports flow one way: ``python_api`` -> ``elastic_kernels`` -> ``_C``.
"""

from python_api.config import ElasticPolicy
from python_api.elastic_linear import (
    ElasticLinear,
    ElasticLinearFunction,
    elasticize,
    no_sync,
    reset_stats,
    runtime_of,
    set_pool_budget,
    stats,
)
from python_api.lora import (
    ElasticLoRAFunction,
    ElasticLoRALinear,
    LoRAConfig,
    convert_to_elastic,
    load_adapter,
    merge_adapters,
    save_adapter,
)
from python_api.runtime import ElasticRuntime, ElasticTensor, Phase, Residency, residency_classes
from python_api.loading import load_elastic
from python_api.planner import Plan, Profile
from python_api.planner.apply import apply_plan, plan
from python_api.planner.measure import measure_peak_bytes, measure_profile

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
