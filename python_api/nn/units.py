"""Which frozen weights are gathered together: units ([Note: units and coalesced gathers] in
python_api/runtime/).

A unit is the smallest module that runs as a whole, as FSDP2 wraps it: for a Hugging Face
model, each instance of a class named in `model._no_split_modules` (the decoder layer); for
another model, the modules the caller names. A weight outside every unit is its own unit.
"""

from __future__ import annotations

import torch.nn as nn


def unit_classes_of(model: nn.Module) -> tuple[str, ...]:
    """The HF `_no_split_modules` class names of `model` (empty for other models)."""
    names = getattr(model, "_no_split_modules", None) or ()
    if isinstance(names, str):
        names = (names,)
    return tuple(str(n) for n in names)


def assign_units(model: nn.Module, weight_names: list[str], unit_modules=None) -> dict[str, str | None]:
    """For each module name in `weight_names`, the name of the unit it belongs to (None: its
    own unit).

    `unit_modules`: None picks the HF decoder blocks (`_no_split_modules`); a collection of
    class names or of `nn.Module` types picks the modules of those classes; a callable
    `(name, module) -> bool` picks modules directly; False gives every weight its own unit.
    The innermost matching ancestor wins.
    """
    if unit_modules is False:
        return {n: None for n in weight_names}
    if unit_modules is None:
        classes = unit_classes_of(model)
        pick = (lambda _n, m: type(m).__name__ in classes) if classes else (lambda _n, _m: False)
    elif callable(unit_modules) and not isinstance(unit_modules, type):
        pick = unit_modules
    else:
        wanted = tuple(unit_modules) if not isinstance(unit_modules, (str, type)) else (unit_modules,)
        if not wanted:
            raise ValueError("unit_modules is empty: give class names, module types, a callable, None or False")
        for w in wanted:
            if not isinstance(w, (str, type)):
                raise TypeError(f"unit_modules entries must be class names or nn.Module types, got {w!r}")
        names = {w for w in wanted if isinstance(w, str)}
        types = tuple(w for w in wanted if isinstance(w, type))

        def pick(_n, m):
            return type(m).__name__ in names or (bool(types) and isinstance(m, types))

    units = [n for n, m in model.named_modules() if n and pick(n, m)]
    out = {}
    for name in weight_names:
        owners = [u for u in units if name.startswith(u + ".")]
        out[name] = max(owners, key=len) if owners else None
    return out
