"""The CLI's planning glue (python_api/finetune/planning.py) against the planner: the plan.json
it writes is what `Plan.load` reads, and `--memory-cap auto` takes the memory that is not ours
off once. Pure Python (torch only for the device object), well under a second."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from elastic_kernels.api.planner import Plan, ProfileError, plan_from_profile, synthetic_profile


def _planner_with(plan, cap, profile=None):
    """A JobPlanner with just the state its writers and cap logic read (no model, no run)."""
    from elastic_kernels.api.finetune.planning import JobPlanner

    jp = JobPlanner.__new__(JobPlanner)
    jp.plan, jp.cap, jp.profile = plan, cap, profile
    return jp


def test_the_cli_plan_json_loads(tmp_path):
    from elastic_kernels.api.finetune.files import write_json
    from elastic_kernels.api.finetune.planning import plan_document

    prof = synthetic_profile("llama2-7b", ranks=8, seq_len=2048, host_tier=True)
    first = plan_from_profile(prof, 40 * 10**9, 64)
    second = plan_from_profile(prof, 24 * 10**9, 64)
    jp = _planner_with(first, 40 * 10**9)
    events = [jp._event(1, None)]
    jp.plan, jp.cap = second, 24 * 10**9
    events.append(jp._event(5, first))
    path = str(tmp_path / "plan.json")
    write_json(path, plan_document(second, events, 12.5))  # what JobPlanner._write writes
    with open(path) as f:
        doc = json.load(f)
    assert doc["adaptations"] == events and doc["profile_seconds"] == 12.5  # the record is in the file
    assert Plan.load(path) == second
    # the run record is checked for shape, not taken on trust
    bad = dict(doc, adaptations="none")
    with pytest.raises(ProfileError, match="plan.adaptations must be a list"):
        Plan.from_dict(bad)
    with pytest.raises(ProfileError, match="plan.profile_seconds"):
        Plan.from_dict(dict(doc, profile_seconds=-1))
    with pytest.raises(ProfileError, match=r"unknown field\(s\) adaptation"):
        Plan.from_dict(dict(doc, adaptation=[]))


def test_auto_cap_counts_the_memory_not_ours_once(monkeypatch):
    """--memory-cap auto on CUDA: the device has `free` bytes free and torch holds `held`; the
    memory not ours (the profile's reserved_bytes, e.g. another process) is already missing from
    free, and the planner's model counts it within the peak: the plan may use free + held of
    our own, so the memory the planner is given is free + held + reserved."""
    free, held, total = 30 << 30, 4 << 30, 40 << 30
    prof = synthetic_profile("llama2-7b", ranks=8, seq_len=2048)  # reserved_bytes: 1.5 GiB (A100 spec)
    assert prof.reserved_bytes > 0
    jp = _planner_with(None, None, prof)
    jp.base_cap, jp.changes, jp.device_auto = None, [], True
    jp.job = SimpleNamespace(device=torch.device("cuda", 0), world_size=1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held)
    cap = jp._cap_at(0)
    assert cap - prof.reserved_bytes == free + held, (cap, free + held)
    # a plan under this cap keeps its own bytes within what the device has for us
    plan = plan_from_profile(prof, min(cap, prof.capacity_bytes), 64)
    assert plan.predicted_peak_bytes - prof.reserved_bytes <= free + held
    # with a cap change in force the smaller of the two counts
    jp.changes = [(1, 20 << 30)]
    assert jp._cap_at(0) == 20 << 30
