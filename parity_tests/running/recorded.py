"""Recorded runs as implementations (docs/testing-your-code.md, docs/cluster.md): ``recorded:path/to/run.npz``.

A trajectory written by ``tfpar run`` (with its manifest beside it,
``run.manifest.json``) stands wherever an implementation name is accepted::

    tfpar compare case.json --impls tf.towers,recorded:runs/ddp-8gpu.npz

This is how a run made elsewhere (another machine, a cluster, a published
result: a *golden* run) is judged later. The recorded run is not run again:
its ``run`` checks that the case being compared is the case the manifest
recorded and hands back the recorded trajectory. The case matches when the
normalised specs agree field by field, ignoring the case's ``name`` and where
its initial weights and data came from (seeds, npz file names, arrays given
directly), and every input array (data, targets, initial weights, sample
weights, shuffle order) hashes the same; otherwise the comparison is bad input
(exit 2) naming the first field that differs.

What the run was (framework, whether it splits the batch, whether its
optimizers are Keras') comes from the manifest's ``implementation`` object;
manifests written before it existed name a built-in, which says it itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.trajectory import Finding, Trajectory, load_trajectory
from parity_tests.running.builtins import SPECS
from parity_tests.running.implementation import Implementation
from parity_tests.running.manifest import _inputs, array_digest, load_manifest, manifest_path

__all__ = ["PREFIX", "recorded_implementation", "case_difference"]

PREFIX = "recorded:"
_DATA_SOURCES = ("generator", "seed", "npz", "arrays", "sample_weights")  # how the arrays were made (hashed instead)
_ABSENT = object()


def _comparable(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as JSON data, without the name and the sources of the input arrays."""
    s = json.loads(json.dumps(spec))
    s.pop("name", None)
    s.pop("init", None)  # seeds, kind, npz file: the arrays themselves are compared by digest
    s["data"] = {k: v for k, v in (s.get("data") or {}).items() if k not in _DATA_SOURCES}
    return s


def _walk(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Every differing leaf as (dotted field, recorded value, this case's value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            yield from _walk(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _walk(x, y, f"{path}[{i}]")
    elif type(a) is not type(b) and not (isinstance(a, int | float) and isinstance(b, int | float)) or a != b:
        yield path, a, b


def _shown(v: Any) -> str:
    return "absent" if v is _ABSENT else repr(v)


def _keras_rounding(diffs: list[tuple[str, Any, Any]]) -> bool:
    """Whether the only differences are the judge's Keras mapping (lr, momentum rounded to float32)."""
    return bool(diffs) and all(
        field in ("optimizer.lr", "optimizer.momentum") and isinstance(a, float | int) and isinstance(b, float | int)
        and float(b) == float(np.float32(a)) for field, a, b in diffs)


def case_difference(manifest: dict[str, Any], case: Case) -> tuple[str, str] | None:
    """``None`` when ``case`` is the manifest's case, else (field, one line saying what differs)."""
    diffs = list(_walk(_comparable(manifest["case"]), _comparable(case.spec), ""))
    if diffs:
        field, a, b = diffs[0]
        return field, f"the recorded run's {field} is {_shown(a)}, this case's {_shown(b)}"
    recorded, here = manifest["inputs"], _inputs(case)
    for key in [*recorded, *(k for k in here if k not in recorded)]:
        if key not in here:
            return f"inputs[{key!r}]", f"the recorded run has the input array {key!r}, this case has none"
        if key not in recorded:
            return f"inputs[{key!r}]", f"this case has the input array {key!r}, the recorded run had none"
        if recorded[key] != here[key]:
            return (f"inputs[{key!r}]", f"the recorded run's input array {key!r} hashes to {recorded[key][:12]}...,"
                                        f" this case's to {here[key][:12]}... (different values)")
    return None


def _implementation_info(m: dict[str, Any], name: str, field: str) -> dict[str, Any]:
    info = m.get("implementation")
    if isinstance(info, dict) and info.get("framework") in ("tf", "torch"):
        return info
    impl = m["impl"]
    spec = next((s for s in SPECS if s.name == impl and s.in_process), None)
    if spec is not None:  # a manifest from before the implementation object: a built-in says it itself
        return {"name": impl, "kind": "builtin", "framework": spec.framework, "parallel": spec.parallel,
                "keras": spec.keras}
    raise CaseError(field, f"a manifest that records its implementation (the 'implementation' object tfpar run"
                           f" writes); {impl!r} is not a built-in, so its framework is unknown", name)


def _check_trajectory(traj: dict[str, np.ndarray], m: dict[str, Any], path: Path, name: str, field: str) -> None:
    """The trajectory file still holds the arrays the manifest hashed."""
    want = m["trajectory"]
    for key in [*want, *(k for k in traj if k not in want)]:
        if key not in traj:
            raise CaseError(field, f"the arrays its manifest records; {path.name} has no {key!r}", name)
        if key not in want:
            raise CaseError(field, f"only the arrays its manifest records; {path.name} also has {key!r}", name)
        if array_digest(traj[key]) != want[key]:
            raise CaseError(field, f"the trajectory its manifest records; {key!r} in {path.name} hashes differently"
                                   " (changed since the run)", name)


def recorded_implementation(name: str, field: str = "--impls") -> Implementation:
    """The implementation for ``recorded:path/to/run.npz``.

    Raises:
        CaseError: (naming ``field``) no file, no manifest beside it, a file or manifest that
            cannot be read, or a trajectory that no longer matches its manifest.
    """
    text = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if not text.strip():
        raise CaseError(field, "recorded:PATH.npz, a trajectory written by tfpar run", name)
    path = Path(text).expanduser()
    if not path.is_file():
        raise CaseError(field, f"an existing trajectory file written by tfpar run; {text} does not exist", name)
    mpath = manifest_path(path)
    if not mpath.is_file():
        raise CaseError(field, f"the manifest {mpath.name} beside {path.name} (tfpar run writes it; without it"
                               " the recorded case cannot be checked)", name)
    try:
        m = load_manifest(mpath)
    except CaseError as e:
        raise CaseError(field, f"a readable manifest {mpath.name} ({e})", name) from None
    try:
        traj = load_trajectory(path)
    except CaseError as e:
        raise CaseError(field, f"a readable trajectory {path.name} ({e})", name) from None
    _check_trajectory(traj, m, path, name, field)
    info = _implementation_info(m, name, field)
    spec = m["case"]
    dtype = spec.get("dtype", "float32") if isinstance(spec, dict) else None
    if dtype not in ("float32", "float64"):
        why = (" (a mixed_bfloat16 run is judged against its own reruns from perturbed inputs, which a recording"
               " cannot make)" if dtype == "mixed_bfloat16" else "")
        raise CaseError(field, f"a manifest whose case dtype is float32 or float64{why}; {mpath.name} has {dtype!r}", name)
    keras = bool(info.get("keras", info.get("kind") == "builtin" and info["framework"] == "tf"))
    data = m.get("finding_data")  # each finding's data (protocol.trajectory.Finding), where recorded
    data = [d if _finding_data_ok(d) else None for d in data] if isinstance(data, list) else []
    findings = [Finding(str(f), data[i] if i < len(data) else None)
                for i, f in enumerate(m.get("findings") or [])]

    def run(case: Case, progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
        found = case_difference(m, case)
        if found is not None:
            text = found[1]
            if _keras_rounding(list(_walk(_comparable(m["case"]), _comparable(case.spec), ""))):
                if not keras:
                    raise CaseError(name, f"a run of this case; {text} (the judge asks for the run with Keras'"
                                          " float32-rounded hyperparameters, to map Keras' rounding onto this side;"
                                          " a recorded run cannot be re-run: record it with optimizer.semantics"
                                          " 'torch' or 'tf', or compare it with a recorded Keras run)")
                # else: Keras rounds lr and momentum to float32 itself, so the recorded run is that run
            else:
                raise CaseError(name, f"a run of this case; {text}")
        out = Trajectory({k: v.copy() for k, v in traj.items()})
        out.findings.extend(findings)
        if progress:
            progress(int(spec.get("steps", len(traj["loss"]))))
        return out

    declared = EngineSpec(name, "recorded", info["framework"], parallel=bool(info.get("parallel", True)),
                          dtypes=(dtype,), keras=bool(keras), rerunnable=False,
                          description=f"a recorded run of {m['impl']} on {spec.get('name', '?')} ({path})")
    return Implementation(declared, run)


def _finding_data_ok(d: object) -> bool:
    """Whether a manifest's finding data is what the judge reads (a hand-edited manifest's other data is dropped: the
    finding keeps its line and still makes the pair a divergence, and is localised as a line without data)."""
    if not isinstance(d, dict):
        return False
    if d.get("kind") != "replicas":
        return True
    norms = d.get("norms")
    return (all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in ("step", "rank"))
            and isinstance(d.get("name"), str)
            and (norms is None or (isinstance(norms, list) and all(
                isinstance(x, list) and len(x) == 2 and all(isinstance(v, (int, float)) for v in x) for x in norms))))
