"""The one residency vocabulary (docs/architecture.md, "Residency") and the names that follow it:
the new names are aliases of the old ones (nothing saved or passed by the old names changes
meaning), and the page's table names every chunk class and every pack mode the code has."""

from __future__ import annotations

import re
from pathlib import Path

from elastic_kernels.api.nn import linear
from elastic_kernels.api.planner.pipeline import RESIDENCIES
from elastic_kernels.api.runtime.tensor import Residency, residency_classes

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _residency_section() -> str:
    text = ARCHITECTURE.read_text()
    m = re.search(r"^## Residency\n(.*?)^## ", text, flags=re.S | re.M)
    assert m, "docs/architecture.md has no '## Residency' section"
    return m.group(1)


def test_micro_batch_is_peak():
    """MICRO_BATCH is PEAK itself (an alias), so a class computed, compared or stored by either
    name is the same; iteration still sees three classes."""
    assert Residency.MICRO_BATCH is Residency.PEAK
    assert Residency(1) is Residency.MICRO_BATCH and Residency["MICRO_BATCH"] is Residency.PEAK
    assert list(Residency) == [Residency.TRANSIENT, Residency.PEAK, Residency.PERSISTENT]
    # 8 chunks, keep 0.5, persist 0.25: 2 persistent, 2 micro-batch, 4 transient
    assert residency_classes(8, 0.5, 0.25) == [Residency.PERSISTENT] * 2 + [Residency.MICRO_BATCH] * 2 + [
        Residency.TRANSIENT] * 4


def test_dequantized_views_keeps_its_former_name():
    assert linear.weight_chunks is linear.dequantized_views


def test_the_page_names_every_class_and_mode():
    """Each chunk class (by its canonical and alias names) and each pack mode appears in the
    Residency section's table, so a class or mode added to the code without the page fails here."""
    section = _residency_section()
    rows = [line for line in section.splitlines() if line.startswith("| **")]
    lifetimes = [re.match(r"\| \*\*([a-z-]+)\*\*", r).group(1) for r in rows]
    assert lifetimes == ["transient", "phase", "micro-batch", "step", "persistent"]
    for name in Residency.__members__:
        assert f"`{name}`" in section, f"Residency.{name} is not in docs/architecture.md's Residency table"
    for mode in RESIDENCIES:
        assert mode in lifetimes and f"`{mode}`" in section, f"pack residency {mode!r} is not a lifetime of the page"
