"""Pipeline packs: stages of a Hugging Face causal LM on torch.distributed.pipelining, each
pack (a run of consecutive decoder layers, one virtual stage) with its frozen weights under
its own elastic runtime on the dp group. The layout (degree, packs, schedule, residency) is
planner/pipeline.py's, pure Python.

  mesh.py       the (pp, dp) mesh with bounded timeouts
  hf_packs.py   packs of Llama-family and GPT-2 models, built by hand
  stage.py      PackStage: the PipelineStage of a pack, with its counters
  residency.py  when each pack's chunks are loaded, prefetched and released
  failure.py    a stage failing mid-step ends every rank
  model.py      PipelinedModel: build, train_step, evaluate, adapters, figures
"""

from ..planner.pipeline import (
    RESIDENCIES,
    SCHEDULES,
    PipelineError,
    PipelineLayout,
    balanced_boundaries,
    schedule_order,
)
from .failure import FailureWatch
from .hf_packs import ARCHITECTURES, architecture_of
from .mesh import PipelineGroups, pipeline_groups
from .model import PipelinedModel
from .residency import PackResidency
from .stage import PackStage, StepCounters

__all__ = [
    "ARCHITECTURES", "RESIDENCIES", "SCHEDULES", "FailureWatch", "PackResidency", "PackStage", "PipelineError",
    "PipelineGroups", "PipelineLayout", "PipelinedModel", "StepCounters", "architecture_of", "balanced_boundaries",
    "pipeline_groups", "schedule_order",
]
