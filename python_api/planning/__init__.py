"""The planner meets a model (the torch side of planning; the planner itself is pure Python in
python_api/planner/):

  measure.py      measure_profile (a Profile from warm-up steps of the real model): the
                  session, its rounds and checks; its parts:
  step_probe.py   one measured step (unit hooks, saved bytes, window peaks, static bytes)
  links.py        timed collectives and copies, fitted as links
  rounds.py       the bounded residency rounds (which units one round keeps resident)
  profile_fit.py  from the measurements to a Profile (time fits, workspaces, dequantization)
  layer_reuse.py  identical layers profiled once
  peaks.py        measure_peak_bytes (the tensor peak of a run), the CPU memory probes
  apply.py        plan(model, profile, ...) and apply_plan(model, plan): the runtime follows the plan
"""

from .apply import apply_plan, check_plan_matches, plan, set_recompute
from .measure import measure_profile
from .peaks import measure_peak_bytes

__all__ = ["apply_plan", "check_plan_matches", "measure_peak_bytes", "measure_profile", "plan", "set_recompute"]
