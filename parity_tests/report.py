"""Reports: ``report.md`` (a table a person reads), ``report.json`` (the same, for machines), PNG plots.

Every file is written atomically. One plot per scenario shows, step by step,
the gap between each judged pair against the bound it was judged by (the
float64 bound, or the float32 noise floor), on a log scale.
"""

from __future__ import annotations

import io
import json
import platform
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .atomic import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from .judge import CaseResult

__all__ = ["versions", "write_report", "render_markdown", "plot_scenario", "scenario_of", "jsonable"]


def versions() -> dict[str, str]:
    """Tool and library versions (read from package metadata: imports nothing heavy)."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("tfpar", "tensorflow-cpu", "tensorflow", "keras", "torch", "numpy", "hypothesis"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def scenario_of(name: str) -> str:
    """``"poly-adam:n4:grad_mean:float32"`` -> ``"poly-adam"``."""
    return name.split(":")[0]


def _fmt(x: float | None) -> str:
    if x is None or np.isnan(x):
        return "-"
    if not np.isfinite(x):
        return str(x)
    return f"{x:.2e}"


def _rows(results: Sequence[CaseResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        spec = r.case.spec
        for p in r.pairs:
            v = p.verdict
            floors = [f for f in (v.floor_a, v.floor_b) if f is not None]
            rows.append({
                "case": r.case.name,
                "scenario": scenario_of(r.case.name),
                "dtype": spec["dtype"],
                "devices": spec["parallel"]["devices"],
                "combine": spec["parallel"]["combine"],
                "optimizer": f"{spec['optimizer']['name']} ({spec['optimizer']['semantics']})",
                "pair": f"{p.reference} vs {p.impl}",
                "status": v.status,
                "expected": "difference" if p.prediction.differ else "parity",
                "as_expected": p.as_expected,
                "rule": v.rule,
                "gap": v.gap,
                "bound": v.bound,
                "noise_floor": max(floors) if floors else None,
                "first_step": v.first_step,
                "key": v.key,
                "why": "; ".join(p.prediction.expected),
                "known": "; ".join(p.prediction.known),
                "mapping": p.mapping,
                "unmapped_gap": p.unmapped_gap,
            })
    return rows


def render_markdown(results: Sequence[CaseResult], title: str, meta: dict[str, Any], plots: dict[str, str]) -> str:
    """The report as Markdown."""
    rows = _rows(results)
    held = sum(r["as_expected"] for r in rows)
    lines = [f"# {title}", ""]
    lines.append(f"**{held} / {len(rows)} verdicts as theory predicts.** "
                 "A verdict is *parity* when the gap stays within the bound at every step, "
                 "*divergence* when it does not; *expected_difference* is a divergence that theory "
                 "predicts (the tool must find it), *unexpected_parity* a predicted difference it did not find.")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    lines.append("| scenario | dtype | devices | combine | optimizer | pair | verdict | expected | ok | greatest gap | bound | noise floor | rule |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['dtype']} | {r['devices']} | {r['combine']} | {r['optimizer']} | {r['pair']} | "
            f"{r['status']} | {r['expected']} | {'yes' if r['as_expected'] else '**NO**'} | {_fmt(r['gap'])} | "
            f"{_fmt(r['bound'])} | {_fmt(r['noise_floor'])} | {r['rule']} |"
        )
    notes = [r for r in rows if r["why"] or r["known"] or r["mapping"] or not r["as_expected"]]
    if notes:
        lines += ["", "## Findings", ""]
        for r in notes:
            what = [f"**{r['case']}**, {r['pair']}: {r['status']}"]
            if r["why"]:
                what.append(f"expected because: {r['why']}")
            if r["known"]:
                what.append(f"known difference: {r['known']}")
            if r["mapping"]:
                what.append(f"mapped ({r['mapping']}); gap without the mapping {_fmt(r['unmapped_gap'])}")
            if r["first_step"] is not None:
                what.append(f"first over the bound at step {r['first_step']} ({r['key']})")
            lines.append("- " + "; ".join(what))
    if plots:
        lines += ["", "## Per-step gaps", ""]
        for scenario, name in plots.items():
            lines += [f"### {scenario}", "", f"![{scenario}]({name})", ""]
    return "\n".join(lines) + "\n"


def plot_scenario(results: Sequence[CaseResult], title: str) -> bytes:
    """PNG: per-step gap (solid) against its bound (dashed) for every pair of every case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_dev: dict[int, list[CaseResult]] = defaultdict(list)
    for r in results:
        by_dev[r.case.devices].append(r)
    devs = sorted(by_dev)
    fig, axes = plt.subplots(1, len(devs), figsize=(4.2 * len(devs), 3.6), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], devs, strict=True):
        for r in by_dev[n]:
            for p in r.pairs:
                v = p.verdict
                if v.status == "unsupported":
                    continue
                gap = np.asarray(v.per_step_gap, dtype=float)
                steps = np.arange(len(gap))
                label = f"{r.case.spec['dtype'][-2:]} {r.case.spec['parallel']['combine']} {p.impl}"
                line, = ax.semilogy(steps, np.maximum(gap, 1e-18), marker=".", label=label)
                bound = v.per_step_bound if v.per_step_bound is not None else np.full(len(gap), v.bound)
                ax.semilogy(steps, np.maximum(np.asarray(bound, float), 1e-18), linestyle="--", color=line.get_color(), alpha=0.6)
        ax.set_title(f"{n} device(s)")
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("relative gap (solid) vs bound (dashed)")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_report(
    results: Sequence[CaseResult], out: Path, *, title: str, meta: dict[str, Any] | None = None,
    trajectories: bool = True,
) -> Path:
    """Write the report folder; returns the path of ``report.md``.

    Contents: ``report.md``, ``report.json``, ``gaps-<scenario>.png``, and for a
    single case also ``trajectories/<impl>@<dtype>.npz`` and ``case/`` (a replayable copy).
    """
    from .case import write_case
    from .trajectory import save_trajectory

    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta.setdefault("versions", versions())
    groups: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        groups[scenario_of(r.case.name)].append(r)
    plots = {}
    for scenario, rs in groups.items():
        name = f"gaps-{_safe(scenario)}.png"
        atomic_write_bytes(out / name, plot_scenario(rs, scenario))
        plots[scenario] = name
    if trajectories and len(results) == 1:
        from .manifest import build_manifest, manifest_path, write_manifest

        r = results[0]
        case_json = write_case(r.case, out / "case")
        from .case import load_case

        replayable = load_case(case_json)  # manifests point at the copy, which travels with the report
        for key, traj in r.trajectories.items():
            path = save_trajectory(out / "trajectories" / f"{_safe(key)}.npz", traj)
            impl, _, variant = key.partition("@")
            if variant == r.case.spec["dtype"]:  # the case as given (other variants are derived runs)
                write_manifest(manifest_path(path), build_manifest(replayable, impl, traj, path.name))
    doc = {"title": title, **meta, "all_as_expected": all(r.as_expected for r in results),
           "rows": _rows(results), "cases": [r.to_dict() for r in results]}
    atomic_write_text(out / "report.json", json.dumps(jsonable(doc), indent=1, allow_nan=False) + "\n")
    return atomic_write_text(out / "report.md", render_markdown(results, title, meta, plots))


def jsonable(x: Any) -> Any:
    """JSON-ready copy: arrays to lists, numpy scalars to Python, NaN/Inf to strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if np.isfinite(v) else str(v)
    return x
