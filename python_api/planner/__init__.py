"""The planner: from a profile and a memory capacity to a plan the runtime follows exactly.

    from . import synthetic_profile, plan_from_profile
    plan = plan_from_profile(synthetic_profile("llama2-70b", ranks=8), 40 * 10**9, global_batch=64)
    print(plan.table())

profile.py  the input (per-rank times, bytes, chunk layouts, links), JSON
shapes.py   synthetic profiles of Llama-2 shapes on named devices
memory.py   the memory model (bytes at each point of an iteration)
cost.py     the cost model (exact all-gather bytes, predicted step time)
plan.py     the `Plan` (JSON, table) and plan_of (a plan for given choices, predicted)
search.py   the search: plan_from_profile, least_memory, plan_with_residency
problem.py  one planning problem of the search: a candidate's memory bound, proposal, exact time
proxy.py    the search's per-unit proxy of the time: keep order, missing bytes, runs
Pure Python: nothing here imports torch or needs a model (python_api/planning/ is the torch side).
"""

from .cost import (
    StepCost,
    allgather_bytes_per_micro_batch,
    allgather_bytes_per_step,
    h2d_bytes_per_micro_batch,
    h2d_bytes_per_step,
    step_cost,
)
from .memory import Choices, MemoryCurve, memory_curve, pool_budget_bytes, pool_pages, timeline
from .plan import LayerPlan, Plan, PlanningError, WeightPlan, plan_of
from .profile import (
    LayerProfile,
    Link,
    OutsideProfile,
    Profile,
    ProfileError,
    WeightFormat,
    WeightProfile,
)
from .search import least_memory, plan_from_profile, plan_with_residency
from .shapes import DEVICES, SHAPES, DeviceSpec, ModelShape, synthetic_profile

__all__ = [
    "DEVICES", "SHAPES", "Choices", "DeviceSpec", "LayerPlan", "LayerProfile", "Link", "MemoryCurve", "ModelShape",
    "OutsideProfile", "Plan", "PlanningError", "Profile", "ProfileError", "StepCost", "WeightFormat", "WeightPlan", "WeightProfile",
    "allgather_bytes_per_micro_batch", "allgather_bytes_per_step", "least_memory", "h2d_bytes_per_micro_batch", "h2d_bytes_per_step",
    "memory_curve", "plan_from_profile", "plan_of",
    "plan_with_residency", "pool_budget_bytes", "pool_pages", "step_cost", "synthetic_profile", "timeline",
]
