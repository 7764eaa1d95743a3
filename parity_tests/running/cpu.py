"""What on this CPU changes the numerics of a bfloat16 computation: the CPU, its flags, the settings.

Read from ``/proc/cpuinfo`` and the environment only (no framework is imported), so every
process can record it: the main process, a torch rank, a ``parity_tests.launch.tf`` worker.
What each framework then does with it is measured by :mod:`parity_tests.running.kernels`.

Why these facts (docs/mixed-precision.md, "Which kernels round how"):

* ``avx512_bf16`` and ``amx_bf16``: native bfloat16 dot products (AVX512_BF16's ``vdpbf16ps``,
  AMX's tiles). oneDNN picks its bfloat16 kernels by them.
* ``avx512f``: TensorFlow hands bfloat16 ops to oneDNN where the CPU has AVX512F (or
  AVX_NE_CONVERT) and ``TF_ENABLE_ONEDNN_OPTS`` is not ``0``; elsewhere it runs Eigen's
  kernels, some of which sum bfloat16 in bfloat16 (measured: the conv filter gradient,
  ``BiasAddGrad``). ``avx512_fp16``: half precision, recorded because oneDNN reads it.
* ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` cap the instruction set oneDNN uses, but not
  TensorFlow's choice between oneDNN and Eigen, nor torch's (``ATEN_CPU_CAPABILITY`` caps
  ATen's vectorised kernels); ``ONEDNN_DEFAULT_FPMATH_MODE`` lets oneDNN compute float32 in
  bfloat16.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["FLAGS", "NUMERIC_ENV", "cpu_facts", "onednn_isa", "read_cpuinfo"]

#: the CPU flags that decide which bfloat16 kernels run (module docstring)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx_ne_convert")
#: environment variables that change which kernels run or how they round
NUMERIC_ENV = ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
               "ONEDNN_DEFAULT_FPMATH_MODE")
# oneDNN's ISA names, best first, and the flags each needs (oneDNN's cpu_isa_traits)
_ISAS = (("avx512_core_amx", ("amx_bf16", "amx_tile", "avx512_bf16")), ("avx512_core_bf16", ("avx512_bf16",)),
         ("avx512_core", ("avx512f",)), ("avx2", ("avx2",)), ("sse41", ()))


def read_cpuinfo(text: str) -> dict[str, Any]:
    """``{"model": ..., "flags": [...]}`` of the first processor in ``/proc/cpuinfo``'s text."""
    model, flags = None, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value.split()
        if model is not None and flags:
            break
    return {"model": model, "flags": flags}


def onednn_isa(flags: set[str], cap: str | None) -> str:
    """The best oneDNN ISA these flags allow, at most ``cap`` (``ONEDNN_MAX_CPU_ISA``'s value, any case)."""
    names = [n for n, _ in _ISAS]
    allowed = [n for n, need in _ISAS if all(f in flags for f in need)]
    if cap and cap.lower() in names:
        allowed = [n for n in allowed if names.index(n) >= names.index(cap.lower())]
    return allowed[0] if allowed else "sse41"


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, Any]:
    path = Path("/proc/cpuinfo")
    info = read_cpuinfo(path.read_text()) if path.is_file() else {"model": None, "flags": []}
    return {"model": info["model"] or platform.processor() or None, "flags": info["flags"]}


def cpu_facts() -> dict[str, Any]:
    """The CPU and the settings that change bfloat16 numerics on it (plain JSON data).

    ``model``: the model name; ``flags``: each of :data:`FLAGS`, true or false;
    ``env``: each of :data:`NUMERIC_ENV` (``None`` when unset); ``onednn_isa``: the oneDNN
    ISA these flags and ``ONEDNN_MAX_CPU_ISA`` allow; ``tf_onednn_bfloat16``: whether
    TensorFlow hands bfloat16 ops to oneDNN here (AVX512F or AVX_NE_CONVERT, and
    ``TF_ENABLE_ONEDNN_OPTS`` not ``0``: TensorFlow's ``IsBF16SupportedByOneDNNOnThisCPU``).
    """
    info = _cpuinfo()
    have = set(info["flags"])
    env = {k: os.environ.get(k) for k in NUMERIC_ENV}
    cap = env["ONEDNN_MAX_CPU_ISA"] or env["DNNL_MAX_CPU_ISA"]
    onednn_opts = (env["TF_ENABLE_ONEDNN_OPTS"] or "1").strip().lower() not in ("0", "false")
    return {
        "model": info["model"],
        "flags": {f: f in have for f in FLAGS},
        "env": env,
        "onednn_isa": onednn_isa(have, cap),
        "tf_onednn_bfloat16": onednn_opts and bool(have & {"avx512f", "avx_ne_convert"}),
    }
