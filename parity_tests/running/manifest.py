"""Run manifests and bit-for-bit replay.

Every trajectory the tool writes gets a manifest beside it
(``<name>.manifest.json``): the normalised case, SHA-256 of every input array
and npz file, the tool, TensorFlow, torch, numpy and Python versions, the
platform, the determinism settings, the environment variables that change
numerics or device placement, and a SHA-256 of every trajectory array. ``cpu``
records the CPU and what changes bfloat16 numerics on it (``parity_tests.running.cpu``:
model, AVX512_BF16 / AMX / AVX512-FP16 flags, oneDNN's ISA, whether TensorFlow hands
bfloat16 to oneDNN); a ``mixed_bfloat16`` run also records ``kernels``: how each op of its
framework sums bfloat16 here (``parity_tests.running.kernels``, the probe). ``gpu`` records the
driver, the GPU names and each framework's CUDA and cuDNN (``parity_tests.running.gpu``: all
``null`` or empty on a machine without a GPU).

The ``implementation`` object says what ran: ``name``, ``kind`` (``builtin``,
``plugin``, ``recorded``), ``framework``, ``parallel``, ``dtypes`` and ``keras``,
and for a plugin also its ``source`` (absolute path), ``source_sha256`` and
``location`` (how it is imported: ``{"path", "module_name", "attr"}`` or
``{"module", "attr"}``). A recorded run (``recorded:RUN.npz``, docs/testing-your-code.md)
reads it to know which framework the run was; older manifests without it are
read as before (built-in names say it themselves).

``tfpar replay MANIFEST`` rebuilds the case (from its generator seeds, or from
the npz files, which must still hash the same), runs the implementation again
and says whether every array is bit-identical, naming the first that is not; before that line,
one line names every recorded version (packages, Python, platform, driver, GPUs, CUDA, cuDNN)
that differs from this machine's (``provenance.version_drift``).
A plugin is re-run from its recorded absolute path (or module) and function,
and only if its source file still hashes as it did at the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.contract.case import Case, case_from_dict
from parity_tests.protocol.atomic import atomic_write_text
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.rows import RowArray, iter_rows

__all__ = ["MANIFEST_SCHEMA", "array_digest", "write_manifest",
           "manifest_path", "load_manifest", "replay_name"]

MANIFEST_SCHEMA = "tfpar-manifest/1"
def array_digest(a: np.ndarray) -> str:
    """SHA-256 over dtype, shape and the C-ordered bytes (so a reshape or cast changes it).

    An array whose rows live in a file (:class:`~parity_tests.protocol.rows.RowArray`) is hashed
    row by row: the same digest, without holding it whole.
    """
    if not isinstance(a, RowArray):
        a = np.asarray(a)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    for _, chunk in iter_rows(a) if a.ndim else [(0, a)]:
        h.update(np.ascontiguousarray(chunk).tobytes())
    return h.hexdigest()


def _file_digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _inputs(case: Case) -> dict[str, str]:
    out = {"x": array_digest(case.x), "y": array_digest(case.y)}
    out.update({f"init/{k}": array_digest(v) for k, v in sorted(case.init.items())})
    if case.perm is not None:  # an explicit shuffle order is an input like the data
        out["perm"] = array_digest(case.perm)
    if case.w is not None:
        out["w"] = array_digest(case.w)
    return out


def _npz_files(case: Case) -> dict[str, str]:
    if case.source is None:
        return {}
    base = case.source.parent
    files = {}
    for section in ("init", "data"):
        name = case.spec[section].get("npz")
        if name:
            files[name] = _file_digest(base / name)
    return files


def manifest_path(trajectory: str | os.PathLike) -> Path:
    """``out/t.npz`` -> ``out/t.manifest.json``."""
    p = Path(trajectory)
    return p.with_name(p.stem + ".manifest.json")


def write_manifest(path: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write a manifest atomically."""
    return atomic_write_text(path, json.dumps(manifest, indent=1, sort_keys=False) + "\n")


def load_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a manifest; problems raise :class:`CaseError` naming the field."""
    p = Path(path)
    if not p.is_file():
        raise CaseError("MANIFEST", f"an existing manifest file; {p} does not exist")
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaseError("MANIFEST", f"a JSON manifest ({type(e).__name__})") from None
    if not isinstance(m, dict) or m.get("schema") != MANIFEST_SCHEMA:
        raise CaseError("schema", f"{MANIFEST_SCHEMA!r} in the manifest", m.get("schema") if isinstance(m, dict) else m)
    for key in ("impl", "case", "inputs", "trajectory"):
        if key not in m:
            raise CaseError(key, "a value in the manifest (the field is missing)")
    return m


def _rebuild(m: dict[str, Any]) -> Case:
    spec = m["case"]
    from_files = "npz" in spec["init"] or "npz" in spec["data"]
    base = None
    if from_files:
        if not m.get("case_file"):
            raise CaseError("case_file", "the case file the npz paths are relative to")
        base = Path(m["case_file"]).parent
        for name, digest in m.get("npz_files", {}).items():
            f = base / name
            if not f.is_file() or _file_digest(f) != digest:
                raise CaseError(f"npz_files[{name!r}]", f"{f} with SHA-256 {digest[:12]}... (missing or changed since the run)")
    case = case_from_dict(spec, base)
    inputs = _inputs(case)
    for k, digest in m["inputs"].items():
        if inputs.get(k) != digest:
            raise CaseError(f"inputs[{k!r}]", "the same input array as the recorded run (it hashes differently)")
    return case


def replay_name(manifest: dict[str, Any]) -> str:
    """The implementation name a replay runs: the recorded name, or for a plugin its recorded location.

    Raises:
        CaseError: (``implementation.source``) the plugin's source file is gone or changed since the run.
    """
    info = manifest.get("implementation")
    if not isinstance(info, dict) or info.get("kind") != "plugin":
        return manifest["impl"]
    location = info.get("location") or {}
    source, digest = info.get("source"), info.get("source_sha256")
    if source and digest:
        f = Path(source)
        if not f.is_file():
            raise CaseError("implementation.source", f"the plugin's source {f} as it was at the run (SHA-256"
                                                     f" {digest[:12]}...); the file no longer exists")
        if _file_digest(f) != digest:
            raise CaseError("implementation.source", f"the plugin's source {f} as it was at the run (SHA-256"
                                                     f" {digest[:12]}...); the file changed since the run")
    if location.get("path") and location.get("attr"):
        return f"{location['path']}:{location['attr']}"
    if location.get("module") and location.get("attr"):
        return f"{location['module']}:{location['attr']}"
    return manifest["impl"]


