"""Reports: ``report.md`` (a table a person reads), ``report.json`` (the same, for machines), PNG plots.

Every file is written atomically. Both record the CPU (``cpu``: ``parity_tests.running.cpu``)
and, when a ``mixed_bfloat16`` case is in the report, how each framework's kernels sum
bfloat16 on it (``kernels``: ``parity_tests.running.kernels``). One plot per scenario shows, step by step,
the gap between each judged pair against the bound it was judged by (the
float64 bound, or the float32 noise floor), on a log scale.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from parity_tests.protocol.atomic import atomic_write_bytes, atomic_write_text
from parity_tests.protocol.rows import nbytes
from parity_tests.reporting.stages import drawable
from parity_tests.running.cpu import cpu_facts
from parity_tests.running.environment import versions
from parity_tests.running.gpu import gpu_facts

if TYPE_CHECKING:
    from parity_tests.session.comparison import CaseResult

__all__ = ["REPORT_SCHEMA", "versions", "write_report", "render_markdown", "plot_scenario", "scenario_of", "jsonable"]


#: ``report.json``'s ``schema``: its fields keep their meaning while it reads ``tfpar-report/1``
REPORT_SCHEMA = "tfpar-report/1"


def scenario_of(name: str) -> str:
    """``"poly-adam:n4:grad_mean:float32"`` -> ``"poly-adam"``."""
    return name.split(":")[0]


def _where_name(loc: dict) -> str:
    """A localisation's name, with the layer (path and type) it belongs to: ``5.2.0.body.1.gamma (5.2.0.body.1 layer_norm)``."""
    name, layer = loc.get("name"), loc.get("layer")
    if not name:
        return "-"
    return f"{name} ({layer})" if layer and not str(name).startswith("layer ") else str(name)


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
                "residual": None if p.residual is None else f"{p.residual.status}, gap {_fmt(p.residual.gap)}"
                                                            f" (bound {_fmt(p.residual.bound)})",
                "notes": list(p.notes),
                "unjudged": list(v.unjudged),
                "localisation": p.localisation,
            })
    return rows


def _cpu_line(cpu: dict[str, Any], kernels: dict[str, Any] | None) -> str:
    """The CPU and, for mixed_bfloat16 cases, how each framework's kernels sum bfloat16 on it (one paragraph)."""
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["flags"].items()
                      if f in ("avx512_bf16", "amx_bf16", "avx512_fp16"))
    text = (f"CPU: {cpu['model']} ({flags}; oneDNN ISA {cpu['onednn_isa']}; TensorFlow hands bfloat16 to oneDNN:"
            f" {'yes' if cpu['tf_onednn_bfloat16'] else 'no'}; TF_ENABLE_ONEDNN_OPTS"
            f" {cpu['env'].get('TF_ENABLE_ONEDNN_OPTS') or 'unset'}).")
    seen = ((kernels or {}).get("torch") or {}).get("torch", {}).get("onednn") or {}
    if seen.get("isa"):
        text = text[:-2] + f"; torch's oneDNN reports {seen['isa']}, bfloat16 conv {seen.get('bfloat16_conv')})."
    for framework, probe in (kernels or {}).items():
        ops = probe.get("ops", {})
        rounding = [f"{op} (rho {v['rho']:.3g})" for op, v in ops.items() if v["accumulates"] == "bfloat16"]
        text += (f" {framework} kernels: {len(ops) - len(rounding)} of {len(ops)} sum in float32"
                 + (f"; partial sums rounded to bfloat16: {', '.join(rounding)}" if rounding else "") + ".")
    return text


def render_markdown(results: Sequence[CaseResult], title: str, meta: dict[str, Any], plots: dict[str, str]) -> str:
    """The report as Markdown."""
    rows = _rows(results)
    held = sum(r["as_expected"] for r in rows)
    lines = [f"# {title}", ""]
    lines.append(f"**{held} / {len(rows)} verdicts as theory predicts.** "
                 "A verdict is *parity* when the gap stays within the bound at every step, "
                 "*divergence* when it does not; *expected_difference* is a divergence that theory "
                 "predicts and that explains the whole gap (with it mapped away the rest is parity), "
                 "*unexpected_parity* a predicted difference it did not find, *inconclusive* a pair in which "
                 "nothing was really compared (docs/tolerance.md).")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    if meta.get("cpu"):
        lines += [_cpu_line(meta["cpu"], meta.get("kernels")), ""]
    if meta.get("trajectories"):
        lines += [f"Trajectories: {meta['trajectories']}.", ""]
    lines.append("| scenario | dtype | devices | combine | optimizer | pair | verdict | expected | ok | greatest gap | bound | noise floor | rule |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['dtype']} | {r['devices']} | {r['combine']} | {r['optimizer']} | {r['pair']} | "
            f"{r['status']} | {r['expected']} | {'yes' if r['as_expected'] else '**NO**'} | {_fmt(r['gap'])} | "
            f"{_fmt(r['bound'])} | {_fmt(r['noise_floor'])} | {r['rule']} |"
        )
    bad = [r for r in rows if not r["as_expected"]]
    if bad:
        lines += ["", "## Not as expected", ""]
        for r in bad:
            where = f"; first over the bound at step {r['first_step']} ({r['key']})" if r["first_step"] is not None else ""
            lines.append(f"- **{r['case']}**, {r['pair']}: {r['status']} (expected {r['expected']}){where}")
    located = [r for r in rows if r.get("localisation") and r["localisation"].get("stage")]
    if located:
        lines += ["", "## Where the runs part", "",
                  "For every pair not at parity: the first bad step and the earliest stage of the step"
                  " (inputs, forward, loss, device_grads, combined_grads, clip, update, state, record) whose"
                  " values differ beyond their bound (docs/localisation.md); inside the step, from both sides re-run"
                  " recording that step's per-device values.", "",
                  "| case | pair | step | stage | device | name | gap | bound | why |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in located:
            loc = r["localisation"]
            lines.append(f"| {r['case']} | {r['pair']} | {loc['first_bad_step']} | {loc['stage']} | "
                         f"{'-' if loc['device'] is None else loc['device']} | {_where_name(loc)} | {_fmt(loc['gap'])} | "
                         f"{_fmt(loc['bound'])} | {loc['explanation']} |")
    chains = {k: v for k, v in plots.items() if k.startswith("stages: ")}
    if chains:
        lines += ["", "### Stage chains of the first bad step", "",
                  "Each bar: a stage's greatest gap over its bound at the first bad step (log scale; red from the"
                  " first stage over the line gap = bound).", ""]
        for label, name in chains.items():
            lines += [f"![{label}]({name})", ""]
    plots = {k: v for k, v in plots.items() if not k.startswith("stages: ")}
    lines += _grouped_findings([r for r in rows if r["why"] or r["known"] or r["mapping"]])
    told = [r for r in rows if r["residual"] or r["notes"] or r["unjudged"]]
    if told:
        lines += ["", "## Residuals, notes and what was not judged", ""]
        for r in told:
            said = ([f"with the predicted difference mapped away ({r['mapping']}): {r['residual']}"] if r["residual"]
                    else []) + r["notes"] + [f"not judged: {u}" for u in r["unjudged"]]
            lines.append(f"- **{r['case']}**, {r['pair']} ({r['status']}): " + "; ".join(said))
    if plots:
        lines += ["", "## Per-step gaps", ""]
        for scenario, name in plots.items():
            lines += [f"### {scenario}", "", f"![{scenario}]({name})", ""]
    return "\n".join(lines) + "\n"


_COLORS = {"torch.ddp": "tab:blue", "tf.single": "tab:orange", "torch.single": "tab:green", "tf.v1": "tab:red",
           "tf.mirrored": "tab:purple", "tf.towers": "tab:brown"}
_STYLES = {"grad_mean": "-", "loss_mean": ":", "param_mean": "--", "async": "-."}


def _grouped_findings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per scenario and finding (not per row): what theory predicted or mapped, and where."""
    if not rows:
        return []
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["scenario"], r["status"], r["why"], r["known"], r["mapping"])].append(r)
    out = ["", "## Findings", ""]
    for (scenario, status, why, known, mapping), rs in groups.items():
        cases = sorted({r["case"] for r in rs})
        pairs = sorted({r["pair"].split(" vs ")[1] for r in rs})
        text = [f"**{scenario}**: {status} in {len(cases)} case(s), against {', '.join(pairs)}"]
        if why:
            text.append(f"expected because: {why}")
        if known:
            text.append(f"known difference: {known}")
        if mapping:
            unmapped = [r["unmapped_gap"] for r in rs if r["unmapped_gap"] is not None]
            text.append(f"mapped ({mapping}); gap without the mapping up to {_fmt(max(unmapped) if unmapped else None)}")
        if status == "expected_difference":
            text.append(f"greatest gap {_fmt(max(r['gap'] for r in rs))}")
        out.append("- " + "; ".join(text))
    return out


def plot_scenario(results: Sequence[CaseResult], title: str) -> bytes:
    """PNG: per-step gap of every judged pair against its bound.

    One row of panels per dtype, one column per device count; colour = the
    implementation judged against the reference, line style = the combine
    rule; dashed lines = the bound (float64: the constant bound; float32: each
    pair's noise-floor bound, in the pair's colour). Exact zeros sit at 1e-18.
    """
    # a Figure of its own, drawn to PNG by Agg, never pyplot: the user's backend (a notebook's inline
    # one) and pyplot's current figure stay as they were
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    dtypes = sorted({r.case.spec["dtype"] for r in results}, reverse=True)  # float64 first
    devs = sorted({r.case.devices for r in results})
    fig = Figure(figsize=(3.6 * len(devs) + 2.2, 3.0 * len(dtypes)))
    axes = fig.subplots(len(dtypes), len(devs), squeeze=False, sharey=True, sharex=True)
    impls, combines = set(), set()
    for r in results:
        ax = axes[dtypes.index(r.case.spec["dtype"])][devs.index(r.case.devices)]
        combine = r.case.spec["parallel"]["combine"]
        for p in r.pairs:
            v = p.verdict
            if v.status == "unsupported" or len(v.per_step_gap) == 0:
                continue
            impls.add(p.impl)
            combines.add(combine)
            color = _COLORS.get(p.impl, "gray")
            gap = drawable(v.per_step_gap)
            steps = np.arange(len(gap))
            ax.semilogy(steps, gap, linestyle=_STYLES.get(combine, "-"), color=color, marker=".", markersize=3, linewidth=1.2)
            if v.per_step_bound is not None:
                ax.semilogy(steps, drawable(v.per_step_bound), linestyle="--",
                            color=color, alpha=0.45, linewidth=0.8)
            else:
                ax.axhline(v.bound, linestyle="--", color="black", linewidth=0.8)
    for i, dtype in enumerate(dtypes):
        for j, n in enumerate(devs):
            ax = axes[i][j]
            ax.set_title(f"{dtype}, {n} device(s)", fontsize=9)
            ax.grid(True, which="major", alpha=0.3)
            if i == len(dtypes) - 1:
                ax.set_xlabel("step")
        axes[i][0].set_ylabel("relative gap")
    handles = [Line2D([], [], color=_COLORS.get(i, "gray"), label=f"tf.towers vs {i}") for i in sorted(impls)]
    handles += [Line2D([], [], color="black", linestyle=_STYLES.get(c, "-"), label=c) for c in sorted(combines)]
    handles += [Line2D([], [], color="black", linestyle="--", linewidth=0.8, label="bound (dashed)")]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    fig.suptitle(f"{title}: per-step gap to the reference (exact zeros drawn at 1e-18, non-finite at 1e30)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (3.6 * len(devs) + 2.2), 0.95))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_.+-]+)?")
_MAX_NAME = 120  # characters of a file name before its suffix (file systems allow 255 bytes)


def _safe(name: str) -> str:
    """A file name for ``name`` (an implementation or case name, ``impl@variant``): safe and unique.

    A plain name (a built-in's ``torch.ddp@float64``) keeps its form (``torch.ddp_float64``). Any
    other (a plugin's path ``../x/y.py:train``, ``recorded:...``) is cut to its last
    :data:`_MAX_NAME` characters of letters, digits, ``_``, ``.``, ``-``, never starting with a
    dot (no hidden files from ``../``), and followed by 8 hex digits of its SHA-256, so two
    names that read alike (``a/b.py:f``, ``a_b.py:f``) never share a file.
    """
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    if _PLAIN.fullmatch(name) and len(readable) <= _MAX_NAME:
        return readable
    readable = readable[-_MAX_NAME:].lstrip("._-") or "run"
    return f"{readable}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def write_report(
    results: Sequence[CaseResult], out: Path, *, title: str, meta: dict[str, Any] | None = None,
    trajectories: bool | None = None, lockstep: Any = None,
) -> Path:
    """Write the report folder; returns the path of ``report.md``.

    Contents: ``report.md``, ``report.json``, ``gaps-<scenario>.png``, and for a
    single case also ``trajectories/<impl>@<dtype>.npz`` (``trajectories``: ``True`` always,
    ``False`` never, ``None`` up to :data:`KEEP_BYTES` in all) and ``case/`` (a replayable copy).
    """
    from parity_tests.contract.case import write_case
    from parity_tests.protocol.trajectory import save_trajectory

    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta.setdefault("versions", versions())
    meta.setdefault("cpu", cpu_facts())
    meta.setdefault("gpu", gpu_facts())  # the driver and GPUs; each framework's CUDA/cuDNN build (running.gpu)
    if any(r.case.spec["dtype"] == "mixed_bfloat16" for r in results) and "kernels" not in meta:
        from parity_tests.running import kernels

        meta["kernels"] = {f: kernels.probe(f) for f in ("tf", "torch")}  # cached: measured when the cases were judged
    groups: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        groups[scenario_of(r.case.name)].append(r)
    plots = {}
    for scenario, rs in groups.items():
        name = f"gaps-{_safe(scenario)}.png"
        atomic_write_bytes(out / name, plot_scenario(rs, scenario))
        plots[scenario] = name
    from parity_tests.reporting.stages import stage_figures

    for case_name, label, png in stage_figures(results):
        name = f"stages-{_safe(case_name)}-{_safe(label.replace(' vs ', '-'))}.png"
        atomic_write_bytes(out / name, png)
        plots[f"stages: {case_name}: {label}"] = name
    kept = _keep(results, trajectories)
    if kept is not None:
        meta["trajectories"] = kept[1]
    if kept is not None and kept[0]:
        from parity_tests.running.manifest import manifest_path, write_manifest
        from parity_tests.running.provenance import build_manifest

        r = results[0]
        case_json = write_case(r.case, out / "case")
        from parity_tests.contract.case import load_case

        replayable = load_case(case_json)  # manifests point at the copy, which travels with the report
        for key, traj in r.trajectories.items():
            path = save_trajectory(out / "trajectories" / f"{_safe(key)}.npz", traj)
            impl, _, variant = key.partition("@")
            if variant == r.case.spec["dtype"]:  # the case as given (other variants are derived runs)
                write_manifest(manifest_path(path), build_manifest(replayable, impl, traj, path.name))
    doc = {"schema": REPORT_SCHEMA, "title": title, **meta, "all_as_expected": all(r.as_expected for r in results),
           "rows": _rows(results), "cases": [r.to_dict() for r in results]}
    if lockstep is not None:  # tfpar compare --lockstep (parity_tests.session.lockstep): per-step one-step gaps
        doc["cases"][0]["lockstep"] = lockstep.to_dict()["lockstep"]
        atomic_write_bytes(out / "lockstep.png", lockstep.plot())
    atomic_write_text(out / "report.json", json.dumps(jsonable(doc), indent=1, allow_nan=False) + "\n")
    md = render_markdown(results, title, meta, plots) + ("" if lockstep is None else lockstep.markdown())
    return atomic_write_text(out / "report.md", md)


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


def write_case_report(result: CaseResult, out: Path, *, lockstep: Any = None, full: bool = False) -> Path:
    """Write ``report.md``, ``report.json``, ``gaps.png``, the trajectories and a replayable case copy.

    ``lockstep``: a :class:`~parity_tests.session.lockstep.LockstepResult` of the same case, written
    as ``"lockstep"`` in the case's entry of ``report.json`` and a per-step section of ``report.md``.
    ``full``: write every run's trajectory whatever its size (by default only up to
    :data:`KEEP_BYTES` in all; the report says what it kept).
    """
    return write_report([result], out, title=f"tfpar compare: {result.case.name}", lockstep=lockstep,
                        trajectories=True if full else None)


#: trajectory files a single-case report writes by default, in all (``tfpar compare --full``: no limit)
KEEP_BYTES = 1 << 30


def _keep(results: Sequence[CaseResult], trajectories: bool | None) -> tuple[bool, str] | None:
    """Whether a single-case report writes its runs' trajectories, and the sentence saying so.

    ``trajectories``: ``True`` always (``--full``), ``False`` never, ``None`` while they
    hold at most :data:`KEEP_BYTES` (a 25 M-parameter model's four runs hold ~25 GB).
    """
    if len(results) != 1 or trajectories is False:
        return None
    size = sum(nbytes(v) for t in results[0].trajectories.values() for v in t.values())
    gb = f"{size / 1e9:.2f} GB" if size >= 1e7 else f"{size / 1e6:.2f} MB"
    if trajectories or size <= KEEP_BYTES:
        return True, f"every run's full trajectory kept in trajectories/ ({gb})"
    return False, (f"trajectories not kept ({gb}, over {KEEP_BYTES / 2**30:.0f} GiB): the verdicts, per-step gaps and"
                   " localisation above are complete; tfpar compare --full writes every step's arrays")
