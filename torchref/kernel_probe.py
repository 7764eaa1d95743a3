"""torch's half of the bfloat16 kernel probe (``parity_tests.running.kernels``): run each op here.

Every op runs as ``torchref.models`` runs it under ``torch.autocast("cpu", dtype=torch.bfloat16)``:
``h @ w`` (bfloat16 out) plus a float32 bias (so a dense bias's gradient is a float32
sum), ``F.conv2d`` with the bias inside on TensorFlow's SAME padding made explicit.
Gradients come from autograd with the probe's ``g`` as the output gradient. The job
:func:`probe_job` runs in a rank of the worker pool, where the torch runs run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["run_probe", "torch_facts", "probe_job"]


def _auto() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _nchw(a: np.ndarray) -> torch.Tensor:
    return _t(a).permute(0, 3, 1, 2)


def _conv_grads(x: np.ndarray, g: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.ones(g.shape[3], x.shape[3], 3, 3, requires_grad=True)
    b = torch.ones(g.shape[3], requires_grad=True)
    with _auto():
        y = F.conv2d(F.pad(_nchw(x), (1, 1, 1, 1)), w, b)
    y.backward(_nchw(g).to(y.dtype))
    return w.grad[:, :, 1, 1].T, b.grad


def run_probe(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each op of ``parity_tests.running.kernels.OPS`` but the TensorFlow-only ones, as float32 numpy."""
    out: dict[str, torch.Tensor] = {}
    i = inputs
    with torch.no_grad(), _auto():
        out["matmul"] = _t(i["matmul"]["a"]) @ _t(i["matmul"]["b"])
        conv = i["conv2d"]
        out["conv2d"] = F.conv2d(_nchw(conv["x"]), _t(conv["k"]).permute(3, 2, 0, 1))[0, :, 0, 0]
        out["sum"] = _t(i["sum"]["g"]).bfloat16().sum(0)
        out["batch matmul"] = torch.matmul(_t(i["batch matmul"]["a"]), _t(i["batch matmul"]["b"]))
        out["softmax"] = torch.softmax(_t(i["softmax"]["x"]).bfloat16(), dim=-1)  # bfloat16 in, as after a bmm
        dw = i["depthwise conv2d"]
        out["depthwise conv2d"] = F.conv2d(_nchw(dw["x"]), _t(dw["k"]).permute(2, 3, 0, 1), groups=2)[0, :, 0, 0]
    x, g = i["matmul weight gradient"]["x"], i["matmul weight gradient"]["g"]
    w = torch.ones(x.shape[1], g.shape[1], requires_grad=True)
    b = torch.ones(i["dense bias gradient"]["g"].shape[1], requires_grad=True)
    with _auto():
        y = _t(x) @ w
        z = torch.zeros(i["dense bias gradient"]["g"].shape, dtype=torch.bfloat16) + b  # float32, as torchref's dense
    y.backward(_t(g).to(y.dtype))
    z.backward(_t(i["dense bias gradient"]["g"]).to(z.dtype))
    out["matmul weight gradient"], out["dense bias gradient"] = w.grad, b.grad
    gi, wi = i["matmul input gradient"]["g"], i["matmul input gradient"]["w"]
    xi = torch.ones(gi.shape[0], wi.shape[0], requires_grad=True)
    with _auto():
        y = xi @ _t(wi)
    y.backward(_t(gi).to(y.dtype))
    out["matmul input gradient"] = xi.grad
    out["conv2d filter gradient"], out["conv2d bias gradient"] = _conv_grads(
        i["conv2d filter gradient"]["x"], i["conv2d filter gradient"]["g"])
    k, gc = i["conv2d input gradient"]["k"], i["conv2d input gradient"]["g"]
    xc = torch.ones(1, k.shape[2], 3, 3, requires_grad=True)
    with _auto():
        y = F.conv2d(F.pad(xc, (1, 1, 1, 1)), _t(k).permute(3, 2, 0, 1))
    y.backward(_nchw(gc).to(y.dtype))
    out["conv2d input gradient"] = xc.grad[0, :, 1, 1]
    xd, gd = i["depthwise conv2d filter gradient"]["x"], i["depthwise conv2d filter gradient"]["g"]
    wd = torch.ones(xd.shape[3], 1, 3, 3, requires_grad=True)
    with _auto():
        y = F.conv2d(F.pad(_nchw(xd), (1, 1, 1, 1)), wd, groups=xd.shape[3])
    y.backward(_nchw(gd).to(y.dtype))
    out["depthwise conv2d filter gradient"] = wd.grad[:, 0, 1, 1]
    return {op: v.detach().float().numpy() for op, v in out.items()}


def _onednn_seen() -> dict[str, str | None]:
    """oneDNN's own word on its ISA and the kernel it picks for a bfloat16 conv here (its verbose
    lines, written to fd 1, captured): ``{"isa": ..., "bfloat16_conv": ...}``, ``None`` where silent."""
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        sys.stdout.flush()
        os.dup2(tmp.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON), torch.no_grad():
                F.conv2d(torch.ones(1, 4, 5, 5, dtype=torch.bfloat16), torch.ones(8, 4, 3, 3, dtype=torch.bfloat16))
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        lines = tmp.read().decode(errors="replace").splitlines()
    isa = next((line.split("isa:", 1)[1] for line in lines if ",info,cpu,isa:" in line), None)
    conv = next((line.split(",")[6] for line in lines if ",exec,cpu,convolution," in line), None)
    return {"isa": isa, "bfloat16_conv": conv}


def torch_facts() -> dict[str, Any]:
    """What torch says of this CPU: its ATen capability, oneDNN (and the ISA oneDNN reports), native bfloat16, AMX."""
    return {
        "onednn": _onednn_seen() if torch.backends.mkldnn.is_available() else {"isa": None, "bfloat16_conv": None},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_available": bool(torch.backends.mkldnn.is_available()),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "mkldnn_bfloat16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx_tile": bool(torch.cpu._is_amx_tile_supported()),
    }


def probe_job(ctx: Any, inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, Any]:
    """The pool job: the probe's outputs and :func:`torch_facts`, from one rank."""
    return {"outputs": run_probe(inputs), "torch": torch_facts()}
