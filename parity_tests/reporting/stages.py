"""The stage chain of a divergent pair as a figure: one bar per stage of the first bad step, gap over bound.

``localisation["chain"]`` (:func:`parity_tests.judging.localise.stage_chain`)
lists, in the order a step runs (inputs, forward, loss, device_grads,
combined_grads, clip), the greatest gap of every stage both implementations
recorded at the first bad step and the bound it was held to. The figure draws
``gap / bound`` per stage on a log scale with the line ``gap = bound``: the
first bar over the line is the stage the report names.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["plot_stage_chain", "stage_figures", "drawable", "LOG_FLOOR", "LOG_CEIL"]

LOG_FLOOR = 1e-18  # an exact zero is drawn here on a log axis
#: a non-finite value (NaN or Inf: one side blew up), or anything above, is drawn here: matplotlib's
#: log axis overflows near 1e300 (warnings, and a singular axis) where a drawn value was
LOG_CEIL = 1e30


def drawable(values: Any) -> np.ndarray:
    """``values`` as a log axis can draw them: zeros at :data:`LOG_FLOOR`, NaN/Inf and above at :data:`LOG_CEIL`."""
    a = np.asarray(values, float)
    return np.clip(np.where(np.isfinite(a), a, LOG_CEIL), LOG_FLOOR, LOG_CEIL)


def plot_stage_chain(chain: Sequence[Mapping[str, Any]], title: str) -> bytes:
    """PNG bytes: ``gap / bound`` of each stage of ``chain`` (bars; red from the first stage over its bound)."""
    # never pyplot: the user's backend (a notebook's inline one) and figures stay theirs
    from matplotlib.figure import Figure

    labels, ratios, over = [], [], False
    colors = []
    for c in chain:
        name = c["stage"] + ("" if c.get("device") is None else f"\ndevice {c['device']}")
        name += "" if not c.get("name") else f"\n{c['name']}"
        # Python floats: an overflowing ratio is inf (drawn at the ceiling), not a numpy warning
        ratio = LOG_CEIL if c["gap"] is None else float(drawable(float(c["gap"]) / float(c["bound"] or 1.0)))
        over = over or ratio > 1.0
        labels.append(name)
        ratios.append(ratio)
        colors.append("tab:red" if over else "tab:green")
    fig = Figure(figsize=(1.3 * max(len(chain), 3) + 1.5, 3.2))
    ax = fig.subplots()
    ax.bar(range(len(ratios)), ratios, color=colors)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("gap / bound")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def stage_figures(results: Sequence[Any]) -> list[tuple[str, str, bytes]]:
    """``(case name, pair label, PNG)`` for every pair whose localisation has a stage chain."""
    out = []
    for r in results:
        for p in r.pairs:
            loc = p.localisation or {}
            if loc.get("chain"):
                label = f"{p.reference} vs {p.impl}"
                title = f"{r.case.name}: {label}, step {loc['first_bad_step']}: {loc.get('stage') or 'every stage agrees'}"
                out.append((r.case.name, label, plot_stage_chain(loc["chain"], title)))
    return out
