"""The elastic frozen-weight runtime: `ElasticRuntime` (runtime.py, its concerns in private
modules beside it) and `ElasticTensor`, one frozen weight under it (tensor.py)."""

from ._gathers import Resident
from ._order import in_backward
from .runtime import ElasticRuntime
from .tensor import ElasticTensor, Phase, Residency, residency_classes, residency_of_counts

__all__ = [
    "ElasticRuntime", "ElasticTensor", "Phase", "Residency", "Resident", "in_backward", "residency_classes",
    "residency_of_counts",
]
