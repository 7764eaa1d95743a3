"""Where a run came from: the manifest written beside a trajectory, and its replay.

A manifest (``docs/case-format.md``, recorded runs) names the case, the implementation
(a plugin's source and its digest), the versions, the CPU and its kernels, the
environment that changes numerics, and a digest of every trajectory array, so that
``tfpar replay`` can re-run it and say whether the result is bit-identical. The file
format (read, write, digests) is :mod:`.manifest`'s; this module resolves the
implementation and runs it, so it sits at the top of ``running``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.protocol import settings
from parity_tests.protocol.trajectory import finding_data, key_order
from parity_tests.running.cpu import cpu_facts
from parity_tests.running.environment import versions
from parity_tests.running.gpu import flatten, gpu_facts
from parity_tests.running.manifest import (
    MANIFEST_SCHEMA,
    _file_digest,
    _inputs,
    _npz_files,
    _rebuild,
    array_digest,
    replay_name,
)

__all__ = ["ENV_VARS", "DETERMINISM", "implementation_record", "build_manifest", "replay", "run_gpu_facts",
           "version_drift"]

# environment that changes numerics, threads or device placement
ENV_VARS = ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
            "ONEDNN_DEFAULT_FPMATH_MODE", "TF_DETERMINISTIC_OPS", "CUDA_VISIBLE_DEVICES", settings.DEVICES.name,
            settings.GPU_MEMORY_MB.name, "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTEROP_THREADS",
            "TF_NUM_INTRAOP_THREADS", "PYTHONHASHSEED")

DETERMINISM = {
    "tensorflow": "tf.config.experimental.enable_op_determinism() (tfpar.devices.configure_devices)",
    "torch": "torch.use_deterministic_algorithms(True), torch.set_num_threads(1) in every rank (torchref.pool)",
}



def implementation_record(impl: str) -> dict[str, Any]:
    """The manifest's ``implementation`` object for the name ``impl`` (resolved by the registry)."""
    from parity_tests.running.registry import resolve

    found = resolve(impl, "--impl")
    out: dict[str, Any] = {"name": impl, "kind": found.kind, "framework": found.framework,
                           "parallel": bool(found.parallel), "dtypes": list(found.dtypes), "keras": bool(found.keras)}
    target = found.plugin
    if found.kind == "plugin" and target is not None:
        source = Path(target.source).resolve() if target.source else None
        out["plugin_kind"] = target.kind
        out["source"] = str(source) if source else None
        out["source_sha256"] = _file_digest(source) if source and source.is_file() else None
        out["location"] = dict(target.location)
    return out



def _kernels(impl: str) -> dict[str, Any] | None:
    """The kernel probe of ``impl``'s framework (``running.kernels``), or ``None`` where this process cannot run it."""
    from parity_tests.running import kernels
    from parity_tests.running.registry import resolve

    framework = resolve(impl, "--impl").framework
    try:
        return kernels.probe(framework)
    except Exception as e:  # a manifest is written after the run: say why the probe is missing, never fail it
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}



def run_gpu_facts(impl: str) -> dict[str, Any]:
    """The manifest's ``"gpu"`` (``running.gpu``): the driver, and the CUDA/cuDNN/GPUs that ``impl``'s framework
    itself reports (torch from a pool rank, TensorFlow where it runs), the other framework's from its build."""
    from parity_tests.running.registry import resolve

    try:
        framework = resolve(impl, "--impl").framework
    except Exception:  # written after the run: an implementation that no longer resolves still gets its driver facts
        framework = None
    return gpu_facts(live=framework)


def build_manifest(case: Case, impl: str, traj: dict[str, np.ndarray], trajectory_file: str | None = None) -> dict[str, Any]:
    """The manifest of one run (plain JSON data)."""
    return {
        "schema": MANIFEST_SCHEMA,
        "impl": impl,
        "implementation": implementation_record(impl),
        "case": case.spec,
        "case_file": str(case.source.resolve()) if case.source else None,
        "inputs": _inputs(case),
        "npz_files": _npz_files(case),
        "versions": versions(),
        "gpu": run_gpu_facts(impl),
        "determinism": DETERMINISM,
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "cpu": cpu_facts(),
        **({"kernels": _kernels(impl)} if case.spec["dtype"] == "mixed_bfloat16" else {}),
        "trajectory_file": trajectory_file,
        "trajectory": {k: array_digest(traj[k]) for k in sorted(traj, key=key_order)},
        "findings": list(getattr(traj, "findings", [])),  # divergences within the run (DDP replicas out of sync)
        "finding_data": [finding_data(f) for f in getattr(traj, "findings", [])],  # what the judge reads of each
    }



def version_drift(manifest: dict[str, Any], now_versions: dict[str, str] | None = None,
                  now_gpu: dict[str, Any] | None = None) -> str | None:
    """One line naming every recorded version that differs now, or ``None`` when none does.

    Compares the manifest's ``versions`` (tool, TensorFlow, Keras, torch, numpy, Python, platform)
    and ``gpu`` (driver, GPU names, each framework's CUDA and cuDNN: ``running.gpu.flatten``) with
    this process's (``now_*``: computed here when not given; ``now_gpu`` after the replay's run, so
    that the replayed framework reports its own). A version recorded and absent now is named; one
    not recorded (an older manifest) is not compared.
    """
    now_versions = versions() if now_versions is None else now_versions
    then_gpu, now_gpu = flatten(manifest.get("gpu")), flatten(gpu_facts() if now_gpu is None else now_gpu)
    changed = []
    for group, then, now, label in (("versions", manifest.get("versions") or {}, now_versions, "{}"),
                                    ("gpu", then_gpu, now_gpu, "gpu {}")):
        for key in then if isinstance(then, dict) else ():
            if group == "gpu" and key not in now:
                continue  # a cuDNN only a live framework reports: not known now, not compared
            was, is_ = str(then[key]), now.get(key)
            if is_ is None:
                changed.append(f"{label.format(key)} absent (recorded {was})")
            elif str(is_) != was:
                changed.append(f"{label.format(key)} {is_} (recorded {was})")
    if not changed:
        return None
    return "versions differ from the recorded run: " + "; ".join(changed)


def replay(manifest: dict[str, Any], run: Any = None) -> tuple[bool, str]:
    """Re-run the manifest's case; returns (bit-identical, one line saying so or naming the first difference).

    A plugin is re-run by its recorded location (absolute path or module, and function), and refused
    (:class:`CaseError` naming ``implementation.source``) when its source file changed since the run.
    """
    from parity_tests.running.harness import run_impl

    run = run or run_impl
    name = replay_name(manifest)
    case = _rebuild(manifest)
    traj = run(case, name)
    got = {k: array_digest(v) for k, v in traj.items()}
    want = manifest["trajectory"]
    for key in sorted(set(want) | set(got), key=key_order):
        if key not in got:
            return False, f"{key}: recorded, but the replay did not produce it"
        if key not in want:
            return False, f"{key}: produced by the replay, absent from the record"
        if got[key] != want[key]:
            return False, f"{key}: first array that differs (recorded {want[key][:12]}..., replayed {got[key][:12]}...)"
    return True, f"bit-identical: all {len(want)} arrays of {manifest['impl']} on {case.name}"
