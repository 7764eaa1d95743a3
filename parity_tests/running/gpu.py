"""The GPUs a run could see: the driver, the device names, and the CUDA and cuDNN each framework has.

Recorded in every manifest (``"gpu"``) and report (``report.json``), so a run made on a GPU
machine says what it ran on, and ``tfpar replay`` can say when that changed. This process
never imports a framework for it (the main process never imports torch, a torch rank never
imports TensorFlow):

- ``driver``, ``gpus``: the driver's own report, ``nvidia-smi --query-gpu=driver_version,name
  --format=csv,noheader`` where it is on ``PATH``, else ``/proc/driver/nvidia/version`` and
  ``/proc/driver/nvidia/gpus/*/information``; ``source`` says which (``None``: no NVIDIA driver).
- ``torch``, ``tensorflow``: ``{"cuda", "cudnn", "gpus", "live"}``. For the framework that made the run
  (``live``), what the framework itself says, where it runs: torch in a rank of the worker pool
  (:mod:`torchref.gpu`), TensorFlow in this process when it is loaded (:mod:`tfpar.gpu`). For the
  other, or when a framework is not loaded here, its build read from its installed files without
  importing it (torch's ``torch/version.py``: ``cuda``; TensorFlow's
  ``tensorflow/python/platform/build_info.py``: ``cuda_version``, ``cudnn_version``), with
  ``cudnn``/``gpus`` ``None`` where only the framework can say (``live: false``). ``None`` for a
  framework not installed.

A field is ``None`` or empty where there is nothing (a CPU build, no driver): on a machine
without a GPU nothing fails, and a field that could not be read is ``None``, never an error.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["gpu_facts", "driver_facts", "parse_nvidia_smi", "parse_proc_version", "parse_proc_information",
           "torch_build", "tf_build", "flatten"]

PROC = Path("/proc/driver/nvidia")
_SMI_TIMEOUT = 10.0  # seconds: nvidia-smi answers in well under a second; a hung driver must not hang a manifest


def parse_nvidia_smi(text: str) -> tuple[str | None, list[str]]:
    """``nvidia-smi --query-gpu=driver_version,name --format=csv,noheader`` -> (driver, GPU names).

    One line per GPU, ``550.54.15, NVIDIA H100 80GB HBM3``; the driver is the same on every line.
    """
    driver, gpus = None, []
    for line in text.splitlines():
        version, _, name = line.partition(",")
        if version.strip() and name.strip():
            driver = driver or version.strip()
            gpus.append(name.strip())
    return driver, gpus


def parse_proc_version(text: str) -> str | None:
    """``/proc/driver/nvidia/version`` (``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue ...``)
    -> ``550.54.15`` (also the open kernel modules' ``... Open Kernel Module for x86_64  550.54.15  ...``)."""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else None


def parse_proc_information(text: str) -> str | None:
    """``/proc/driver/nvidia/gpus/<bus id>/information`` -> the ``Model:`` line's name."""
    m = re.search(r"^Model:\s*(.+?)\s*$", text, re.MULTILINE)
    return m.group(1) if m else None


@functools.cache
def driver_facts() -> dict[str, Any]:
    """``{"driver": "550.54.15" | None, "gpus": [name, ...], "source": "nvidia-smi" | "/proc/driver/nvidia" | None}``."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version,name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=_SMI_TIMEOUT, check=False)
            driver, gpus = parse_nvidia_smi(out.stdout) if out.returncode == 0 else (None, [])
            if driver:
                return {"driver": driver, "gpus": gpus, "source": "nvidia-smi"}
        except (OSError, subprocess.SubprocessError):
            pass  # the driver's files below may still say
    try:
        driver = parse_proc_version((PROC / "version").read_text(errors="replace"))
    except OSError:
        driver = None
    gpus = []
    for info in sorted((PROC / "gpus").glob("*/information")) if driver else []:
        try:
            name = parse_proc_information(info.read_text(errors="replace"))
        except OSError:
            name = None
        if name:
            gpus.append(name)
    return {"driver": driver, "gpus": gpus, "source": str(PROC) if driver else None}


def _package_file(package: str, *parts: str) -> Path | None:
    """A file of an installed package, found without importing it (``None``: not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def _assigned(path: Path, name: str) -> Any:
    """The literal assigned to ``name`` at the top of the Python file ``path`` (``dict(...)``,
    ``collections.OrderedDict([...])`` read as their literal argument), or ``None``."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets) or node.value is None:
            continue
        value = node.value
        if isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords:
            value = value.args[0]  # OrderedDict([...]) / dict([...])
        try:
            found = ast.literal_eval(value)
        except ValueError:
            return None
        return dict(found) if isinstance(found, list) else found
    return None


def torch_build(version_file: Path | None = None) -> dict[str, Any] | None:
    """torch's CUDA build from ``torch/version.py`` without importing torch (``None``: torch not installed)."""
    path = version_file or _package_file("torch", "version.py")
    if path is None or not path.is_file():
        return None
    cuda = _assigned(path, "cuda")
    return {"cuda": cuda if isinstance(cuda, str) else None, "cudnn": None, "gpus": None, "live": False}


def tf_build(build_info_file: Path | None = None) -> dict[str, Any] | None:
    """TensorFlow's CUDA and cuDNN build from its ``build_info.py`` without importing it (``None``: not installed)."""
    path = build_info_file or _package_file("tensorflow", "python", "platform", "build_info.py")
    if path is None or not path.is_file():
        return None
    info = _assigned(path, "build_info")
    info = info if isinstance(info, dict) else {}
    cuda, cudnn = info.get("cuda_version"), info.get("cudnn_version")
    return {"cuda": str(cuda) if cuda else None, "cudnn": str(cudnn) if cudnn else None, "gpus": None, "live": False}


@functools.cache
def _live(framework: str) -> dict[str, Any] | None:
    """What ``framework`` itself says, where it runs; ``None`` where it cannot say without an import here."""
    if framework == "torch":
        if "torch" in sys.modules and "tensorflow" not in sys.modules:  # a torch-only process: a rank, launch.torch
            from torchref.gpu import gpu_facts as torch_facts

            return torch_facts()
        if "torchref.pool" not in sys.modules:  # no worker pool in this process: nothing ran torch here
            return None
        from parity_tests.running.backends import run_torch_job
        from torchref.jobs import JobRef

        (facts,) = run_torch_job("torch gpu facts", JobRef("torchref.gpu", "gpu_job"), None, 1)
        return facts
    if framework == "tf" and "tensorflow" in sys.modules:
        from tfpar.gpu import gpu_facts as tf_facts

        return tf_facts()
    return None


def gpu_facts(live: str | None = None) -> dict[str, Any]:
    """The manifest's ``"gpu"`` object (module docstring); ``live``: ``"tf"`` or ``"torch"``, the run's framework."""
    out: dict[str, Any] = dict(driver_facts())
    for framework, key, build in (("torch", "torch", torch_build), ("tf", "tensorflow", tf_build)):
        facts = build()
        if facts is not None and live == framework:
            try:
                said = _live(framework)
                facts = facts if said is None else {**said, "live": True}
            except Exception:  # the record is written after the run: a fact that cannot be had stays unknown
                pass
        out[key] = facts
    return out


def flatten(gpu: Any) -> dict[str, str]:
    """``{"driver": "550.54.15", "names": "NVIDIA H100 80GB HBM3", "torch.cuda": "12.8", ...}`` for comparing two runs.

    ``"none"`` where the field is known to be empty (no driver, a CPU build); a framework's ``cudnn``
    and ``gpus`` only where the framework itself said them (``live``): a replay compares only what
    both runs knew. A framework that is not installed is left out (its version says so).
    """
    def text(value: Any) -> str:
        if isinstance(value, list):
            return ", ".join(map(str, value)) if value else "none"
        return "none" if value is None else str(value)

    out: dict[str, str] = {}
    if not isinstance(gpu, dict):
        return out
    out["driver"], out["names"] = text(gpu.get("driver")), text(gpu.get("gpus"))
    for framework in ("torch", "tensorflow"):
        facts = gpu.get(framework)
        if not isinstance(facts, dict):
            continue
        out[f"{framework}.cuda"] = text(facts.get("cuda"))
        if facts.get("live"):
            out[f"{framework}.cudnn"], out[f"{framework}.gpus"] = text(facts.get("cudnn")), text(facts.get("gpus"))
    return out
