"""Models built from the case's layer list, in torch.

Parameters are stored in canonical (TensorFlow) layouts, dense kernel
``[in, out]``, conv kernel ``[kh, kw, in, out]`` (HWIO), so their gradients
come out in canonical layouts too; names are canonical with ``_`` for ``.``
inside the module (``0_kernel``), since torch reserves the dot. Batch-norm
moving statistics are buffers (``3_moving_mean``), which DDP broadcasts from
rank 0 at every forward.

Layouts at the boundary: inputs arrive NHWC (canonical) and images are turned
into NCHW once, at the model's input; conv kernels are permuted HWIO -> OIHW
where they are used; ``flatten`` permutes NCHW -> NHWC before flattening, so
its order is TensorFlow's (channels fastest); dropout masks arrive NHWC and are
permuted like the activations.

Architecture layers (``docs/layers.md``; each what the torch class named computes,
pinned by ``tests/test_layers_vocabulary.py``): ``dense`` on the last axis of any rank
(``h @ kernel + bias``; a 4-D input is turned NHWC for it and back); ``activation``
(``torch.relu``, ``tanh``, ``sigmoid``, ``F.gelu`` with ``approximate`` ``none``/``tanh``,
``F.silu``, ``torch.softmax`` over the canonical last axis); ``layer_norm``
(``F.layer_norm``, ``nn.LayerNorm``'s function) and ``rms_norm`` (``F.rms_norm``,
``nn.RMSNorm``'s) over the canonical last axis; ``residual`` (``body(x) + shortcut(x)``);
``repeat``; ``avg_pool2d`` (``F.avg_pool2d``; where TensorFlow's padding is not what
torch's symmetric ``padding=`` expresses, ``F.pad`` with zeros first, and without
``count_padding`` the window sums divided by the real values' count, as
``count_include_pad=False`` divides); ``global_avg_pool2d``
(``F.adaptive_avg_pool2d(h, 1)``, ``nn.AdaptiveAvgPool2d``'s); ``channel_pad``
(``F.pad`` on the channel axis); ``reshape`` (in NHWC order); ``position_embedding``
(``x + embeddings[:T]``), ``class_token`` (``torch.cat`` of the expanded token before
the tokens), ``take_token`` (``x[:, index]``); ``embedding`` (``F.embedding``, ``nn.Embedding``'s, on
int64 token ids) and ``tied_logits`` (``h @ embeddings.T``): :mod:`torchref.tokens`; ``attention`` (``nn.MultiheadAttention``'s computation,
:mod:`torchref.attention`, its parameters ``<path>.q.kernel``... converted from Keras' layout there); ``depthwise_conv2d`` (``F.conv2d(groups=C)``, ``nn.Conv2d``'s
depthwise form, with the kernel ``[kh, kw, C, M]`` turned into ``[C*M, 1, kh, kw]``). Under ``semantics: tf`` a
GELU uses TensorFlow's float32-rounded constants (``1/sqrt(2)`` or ``0.044715``).
Nested parameters keep their canonical path (``3.body.1.kernel`` is ``3_body_1_kernel``
inside the module, and :meth:`CaseModel.canonical` maps it back).

TensorFlow's SAME padding puts the odd extra row at the bottom/right
(``parity_tests.protocol.specs.same_padding``); torch's ``padding=`` pads both sides
equally, so SAME is done as ``F.pad`` (zeros for conv, ``-inf`` for max
pooling, which can then never be selected) followed by a 'valid' op.

Batch norm (training mode; ``m`` the case's momentum in TensorFlow's convention):

local, semantics native/torch
    ``F.batch_norm(..., training=True, momentum=1 - m)``: torch's own kernel;
    normalises with the biased batch variance but updates ``running_var`` with
    the *unbiased* one, ``var n / (n - 1)``.
local, semantics tf
    the same normalisation; the buffers get Keras' update with the biased variance.
sync
    torch's ``nn.SyncBatchNorm`` refuses CPU tensors (torch 2.13:
    "SyncBatchNorm expected input tensor to be on GPU or XPU ..."), so its math
    is written out, all-reduced over the group with the differentiable
    ``torch.distributed.nn.functional.all_reduce`` (its backward all-reduces the
    gradients, as SyncBatchNorm's backward does). Semantics native/torch: what
    SyncBatchNorm computes, each rank's mean ``m_r`` and biased variance ``v_r`` over
    its ``n_r`` values (``batch_norm_stats``), merged with the counts
    (``batch_norm_gather_stats_with_counts``): ``mu = sum n_r m_r / n``,
    ``var = sum n_r (v_r + (m_r - mu)^2) / n``; ``running_var`` gets ``var n / (n - 1)``
    with the global ``n``. Semantics tf: Keras' one pass, ``sum x``, ``sum x^2`` and the
    count summed, ``mu = S / n``, ``var = max(Q / n - mu^2, 0)``, biased ``var`` kept.
    The two agree in exact arithmetic; the one pass loses about ``(mu/sigma)^2 u`` of the
    variance (``u`` the dtype's rounding unit: docs/layers.md).

Mixed precision (case dtype ``mixed_bfloat16``): the parameters stay float32 and the
caller runs the forward pass under ``torch.autocast("cpu", dtype=torch.bfloat16)``
(:func:`torchref.ddp._shard_loss`, around the DDP wrapper), which decides per op
(torch 2.13's CPU autocast lists): ``matmul``/``linear``/``conv2d`` cast their
operands to bfloat16 (conv2d its bias too) and return bfloat16; anything not on a
list runs in its inputs' promoted dtype. A dense layer is ``nn.Linear``'s ``F.linear``
under autocast (:func:`_dense`): input, weight and bias cast to bfloat16, the bias added
inside the product, bfloat16 out, and the activation in bfloat16. Max pooling, flatten and
dropout keep bfloat16. Batch norm computes in float32 and returns bfloat16
(:meth:`CaseModel._batch_norm`, what torch's own CPU kernel does for bfloat16
input: float32 accumulation, output in the input's dtype). The loss is computed
in float32 (:func:`torchref.losses.model_loss`). ``compute`` only records the
setting; the casts are autocast's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from . import tokens

__all__ = ["CaseModel", "same_padding", "STATE_KINDS"]

STATE_KINDS = ("moving_mean", "moving_variance")
_ACT = {"none": lambda t: t, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu}
# TensorFlow's tf.nn.gelu constants as they reach a float64 tensor: through float32
_TF_SQRT_HALF = float(np.float32(0.7071067811865476))
_TF_GELU_CUBIC = float(np.float32(0.044715))


def gelu(h: torch.Tensor, approximate: bool, semantics: str = "native") -> torch.Tensor:
    """GELU: ``F.gelu`` under ``native`` and ``torch``; under ``tf`` the formula of ``tf.nn.gelu``
    with its float32-rounded constant (``0.5 x erfc(-x c)``, ``c = float32(1/sqrt(2))``; tanh form
    with ``float32(0.044715)``), so both sides compute TensorFlow's function."""
    if semantics != "tf":
        return F.gelu(h, approximate="tanh" if approximate else "none")
    if approximate:
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + _TF_GELU_CUBIC * torch.pow(h, 3))))
    return 0.5 * h * torch.erfc(-h * _TF_SQRT_HALF)


def _activate(h: torch.Tensor, fn: str, layer: dict) -> torch.Tensor:
    """Activation ``fn`` on ``h`` (NCHW when 4-D: softmax over the canonical last axis, channels)."""
    if fn in ("gelu", "gelu_tanh"):
        return gelu(h, fn == "gelu_tanh", layer.get("semantics", "native"))
    if fn == "softmax":
        return torch.softmax(h, dim=1 if h.dim() == 4 else -1)
    return _ACT[fn](h)


def _last_axis(h: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` applied over the canonical last axis (channels: dim 1 of an NCHW tensor)."""
    if h.dim() != 4:
        return fn(h)
    return fn(h.movedim(1, -1)).movedim(-1, 1)


def _pads(h: torch.Tensor, padding, window: list[int], strides: list[int]) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` for NCHW ``h``: TensorFlow's SAME, explicit, or none for valid."""
    if padding == "valid":
        return 0, 0, 0, 0
    if padding == "same":
        (top, bottom), (left, right) = same_padding(h.shape[2], window[0], strides[0]), same_padding(h.shape[3], window[1], strides[1])
    else:
        (top, bottom), (left, right) = padding
    return left, right, top, bottom


def _avg_pool(h: torch.Tensor, layer: dict) -> torch.Tensor:
    pool, strides = tuple(layer["pool_size"]), tuple(layer["strides"])
    pads = _pads(h, layer["padding"], layer["pool_size"], layer["strides"])
    if not any(pads):
        return F.avg_pool2d(h, pool, strides)
    padded = F.pad(h, pads)
    if layer["count_padding"]:  # count_include_pad=True: the window size divides
        return F.avg_pool2d(padded, pool, strides)
    # count_include_pad=False: the window's sum over its real values' count
    sums = F.avg_pool2d(padded, pool, strides, divisor_override=1)
    counts = F.avg_pool2d(F.pad(torch.ones_like(h[:1, :1]), pads), pool, strides, divisor_override=1)
    return sums / counts


def same_padding(n: int, k: int, s: int) -> tuple[int, int]:
    """TensorFlow's SAME padding ``(before, after)`` along one axis of length ``n`` (window ``k``, stride ``s``)."""
    total = max((math.ceil(n / s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def _pad_same(h: torch.Tensor, window: list[int], strides: list[int], value: float) -> torch.Tensor:
    """``h`` NCHW padded as TensorFlow's SAME would (extra row/column after)."""
    top, bottom = same_padding(h.shape[2], window[0], strides[0])
    left, right = same_padding(h.shape[3], window[1], strides[1])
    if top == bottom == left == right == 0:
        return h
    return F.pad(h, (left, right, top, bottom), value=value)


def _is_state(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in STATE_KINDS


def _dense(kernel: torch.Tensor, bias: torch.Tensor | None):
    """A dense layer on the last axis: ``t @ kernel + bias``; under CPU autocast ``F.linear(t, kernel.T, bias)``.

    The latter is ``nn.Linear``'s call, which autocast runs in bfloat16 with the bias cast too and added
    inside the product (one rounding, bfloat16 out), where ``t @ kernel + bias`` would add the float32
    bias after a bfloat16 product and stay float32. Outside autocast the two differ by rounding only,
    and the float path keeps ``@ +`` (its recorded trajectories stay as they were).
    """
    def apply(t: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            return F.linear(t, kernel.T, bias)
        return t @ kernel if bias is None else t @ kernel + bias

    return apply


class CaseModel(nn.Module):
    """The case's model.

    Args:
        layers: validated ``model.layers``.
        init: canonical name -> initial value (numpy), parameters and moving statistics.
        dtype: ``torch.float32`` or ``torch.float64``.
        batch_norm: ``local`` or ``sync`` (the case's ``parallel.batch_norm``).
        group: the process group that ``sync`` statistics are all-reduced over
            (``None``: this process's batch is the whole batch).
        compute: ``torch.bfloat16`` when the forward pass is to run under CPU autocast
            (mixed precision; the caller enters it), else ``None``.
    """

    def __init__(self, layers: list[dict], init: Mapping[str, np.ndarray], dtype: torch.dtype, *,
                 batch_norm: str = "local", group: dist.ProcessGroup | None = None,
                 compute: torch.dtype | None = None) -> None:
        super().__init__()
        self.compute = compute
        if batch_norm not in ("local", "sync"):
            raise ValueError(f"batch_norm must be local or sync, got {batch_norm!r}")
        self.layers = layers
        self.batch_norm, self.group = batch_norm, group
        #: when a dict: every layer's output (canonical layout, detached copy) by layer index, and by
        #: path inside residual / repeat (``3.body.1``), set by the capture step of a run
        #: (docs/localisation.md ``forward`` stage)
        self.trace: dict[str, np.ndarray] | None = None
        #: the keep-masks of the forward pass running (dropout and attention layers, by path)
        self._masks: Mapping[str, torch.Tensor] | None = None
        #: module name (``3_body_1_kernel``) -> canonical name (``3.body.1.kernel``); torch reserves the dot
        self._canonical = {k.replace(".", "_"): k for k in init}
        self.params = nn.ParameterDict(
            {k.replace(".", "_"): nn.Parameter(torch.tensor(np.asarray(v), dtype=dtype)) for k, v in init.items() if not _is_state(k)}
        )
        for k, v in init.items():
            if _is_state(k):
                self.register_buffer(k.replace(".", "_"), torch.tensor(np.asarray(v), dtype=dtype))

    def canonical(self) -> dict[str, nn.Parameter]:
        """Canonical name -> trainable parameter, in creation order."""
        return {self._canonical[k]: p for k, p in self.params.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """Canonical name -> moving-statistics buffer, in creation order."""
        return {self._canonical[k]: b for k, b in self.named_buffers()}

    def _p(self, i: int | str, kind: str) -> torch.Tensor:
        return self.params[f"{i}_{kind}".replace(".", "_")]

    def _layer(self, path: str, layer: dict, h: torch.Tensor) -> torch.Tensor:
        """A layer of the architecture vocabulary (docs/layers.md) at ``path`` (``3``, ``3.body.1``) on ``h`` (NCHW when 4-D)."""
        kind = layer["type"]
        if kind in tokens.TOKEN_LAYERS:  # embedding, tied_logits (torchref.tokens)
            return tokens.layer(kind, layer, self._p, path, h)
        if kind == "dense":  # the last axis of any rank
            kernel, bias = self._p(path, "kernel"), self._p(path, "bias") if layer["use_bias"] else None
            h = _last_axis(h, _dense(kernel, bias))
            return _activate(h, layer["activation"], layer)
        if kind == "activation":
            return _activate(h, layer["fn"], layer)
        if kind == "conv2d":
            h = F.pad(h, _pads(h, layer["padding"], layer["kernel_size"], layer["strides"]))
            w = self._p(path, "kernel").permute(3, 2, 0, 1).contiguous()  # HWIO -> OIHW: contiguous, as nn.Conv2d's weight (a view: slow_conv2d refuses to backpropagate to it for 1 filter)
            h = F.conv2d(h, w, self._p(path, "bias") if layer["use_bias"] else None, stride=tuple(layer["strides"]))
            return _ACT[layer["activation"]](h)
        if kind == "depthwise_conv2d":  # nn.Conv2d(C, C*M, groups=C): kernel [kh, kw, C, M] -> [C*M, 1, kh, kw]
            h = F.pad(h, _pads(h, layer["padding"], layer["kernel_size"], layer["strides"]))
            kernel = self._p(path, "kernel")
            kh, kw, c, m = kernel.shape
            w = kernel.permute(2, 3, 0, 1).reshape(c * m, 1, kh, kw)
            h = F.conv2d(h, w, self._p(path, "bias") if layer["use_bias"] else None, stride=tuple(layer["strides"]), groups=c)
            return _ACT[layer["activation"]](h)
        if kind == "max_pool2d":
            h = F.pad(h, _pads(h, layer["padding"], layer["pool_size"], layer["strides"]), value=-math.inf)
            return F.max_pool2d(h, tuple(layer["pool_size"]), tuple(layer["strides"]))
        if kind == "avg_pool2d":
            return _avg_pool(h, layer)
        if kind == "global_avg_pool2d":
            return F.adaptive_avg_pool2d(h, 1).flatten(1)
        if kind == "layer_norm":
            gamma = self._p(path, "gamma") if layer["scale"] else None
            beta = self._p(path, "beta") if layer["center"] else None
            return _last_axis(h, lambda t: F.layer_norm(t, (t.shape[-1],), gamma, beta, layer["epsilon"]))
        if kind == "rms_norm":
            return _last_axis(h, lambda t: F.rms_norm(t, (t.shape[-1],), self._p(path, "scale"), layer["epsilon"]))
        if kind == "residual":
            body = self._sequence(f"{path}.body", layer["body"], h)
            shortcut = self._sequence(f"{path}.shortcut", layer["shortcut"], h)
            if layer.get("semantics", "native") == "tf" and torch.is_autocast_enabled("cpu"):
                # Keras' Add: both inputs cast to bfloat16 and added in bfloat16 (autocast would promote to float32)
                body, shortcut = body.to(torch.bfloat16), shortcut.to(torch.bfloat16)
            return _ACT[layer["activation"]](body + shortcut)
        if kind == "repeat":
            for r in range(layer["count"]):
                h = self._sequence(f"{path}.{r}", layer["body"], h)
            return h
        if kind == "channel_pad":
            pads = (0, 0, 0, 0, layer["before"], layer["after"]) if h.dim() == 4 else (layer["before"], layer["after"])
            return F.pad(h, pads)
        if kind == "reshape":
            h = h.permute(0, 2, 3, 1) if h.dim() == 4 else h  # channels-last order, as TensorFlow reshapes
            known = math.prod(d for d in layer["shape"] if d != -1)
            target = [math.prod(h.shape[1:]) // known if d == -1 else d for d in layer["shape"]]
            h = h.reshape(h.shape[0], *target)
            return h.permute(0, 3, 1, 2) if h.dim() == 4 else h
        if kind == "position_embedding":  # [B, T, D]: the first T rows of [length, D]
            return h + self._p(path, "embeddings")[: h.shape[1]]
        if kind == "class_token":
            token = self._p(path, "token")
            return torch.cat([token.expand(h.shape[0], 1, token.shape[-1]), h], dim=1)
        if kind == "take_token":
            return h[:, layer["index"]]
        if kind == "attention":  # nn.MultiheadAttention's computation (torchref.attention)
            from torchref.attention import attention

            return attention(path, layer, lambda name: self._p(path, name), h, (self._masks or {}).get(path))
        if kind == "flatten":
            return (h.permute(0, 2, 3, 1) if h.dim() == 4 else h).reshape(h.shape[0], -1)
        if kind == "batch_norm":  # inside a residual or repeat body: state by path (3_body_1_moving_mean)
            return self._batch_norm(path, layer, h)
        if kind == "dropout":
            return self._dropout(path, layer, h, self._masks)
        raise ValueError(f"layer {path}: unknown type {kind!r}")

    def _dropout(self, path: str, layer: dict, h: torch.Tensor, masks: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """Dropout at ``path`` with its given keep-mask (canonical layout): torch's arithmetic,
        ``noise = bernoulli(1 - p) / (1 - p)``, ``input * noise``."""
        if layer["rate"] == 0.0:
            return h
        if masks is None or path not in masks:
            raise ValueError(f"layer {path}: a dropout layer needs its keep-mask (payload['masks'][{path!r}])")
        keep = masks[path]
        keep = keep.permute(0, 3, 1, 2) if keep.dim() == 4 else keep
        return h * (keep.to(h.dtype) / (1.0 - layer["rate"]))

    def _sequence(self, prefix: str, layers: list[dict], h: torch.Tensor) -> torch.Tensor:
        """A nested layer list (a residual's body or shortcut, a repeat's body) at path ``prefix``."""
        for j, layer in enumerate(layers):
            h = self._layer(f"{prefix}.{j}", layer, h)
            self._trace(f"{prefix}.{j}", h)  # the forward stage at block granularity, by path
        return h

    def _trace(self, key: str, h: torch.Tensor) -> None:
        """Keep ``h`` (canonical layout, detached copy) as layer ``key``'s output when tracing."""
        if self.trace is None:
            return
        out = (h.permute(0, 2, 3, 1) if h.dim() == 4 else h).detach()
        # bfloat16 -> float32 is exact (numpy has no bfloat16); float64 stays float64
        self.trace[key] = (out.float() if out.dtype == torch.bfloat16 else out).numpy().copy()

    def _batch_norm(self, i: int | str, layer: dict, h: torch.Tensor) -> torch.Tensor:
        gamma, beta = self._p(i, "gamma"), self._p(i, "beta")
        key = str(i).replace(".", "_")  # a nested layer's buffers: 3_body_1_moving_mean
        rm, rv = getattr(self, f"{key}_moving_mean"), getattr(self, f"{key}_moving_variance")
        m, eps, sem = layer["momentum"], layer["epsilon"], layer["semantics"]
        out_dtype = h.dtype
        if h.dtype == torch.bfloat16:  # float32 statistics and normalisation, bfloat16 out (class docstring)
            h = h.float()
        channels_last = h.dim() == 3  # [B, L, C]: torch wants the channels at dim 1
        if channels_last:
            h = h.movedim(-1, 1)
        dims = [d for d in range(h.dim()) if d != 1]
        if self.batch_norm == "local" and sem != "tf":
            out = F.batch_norm(h, rm, rv, gamma, beta, training=True, momentum=1.0 - m, eps=eps)
        elif self.batch_norm == "local":
            out = F.batch_norm(h, None, None, gamma, beta, training=True, eps=eps)
            with torch.no_grad():
                var, mean = torch.var_mean(h, dim=dims, correction=0)
                rm.copy_(rm * m + mean * (1.0 - m))  # Keras' update, biased variance
                rv.copy_(rv * m + var * (1.0 - m))
        else:
            c = h.shape[1]
            count = torch.tensor([h.numel() / c], dtype=h.dtype)
            if sem == "tf":  # Keras' synchronized moments: one pass, var = max(Q/n - mu^2, 0)
                stats = self._all_reduce(torch.cat([h.sum(dim=dims), (h * h).sum(dim=dims), count]))
                n = stats[-1]
                mean = stats[:c] / n
                var = torch.clamp(stats[c:2 * c] / n - mean * mean, min=0.0)
            else:  # SyncBatchNorm's: each rank's mean and variance, merged with the counts
                var_r, mean_r = torch.var_mean(h, dim=dims, correction=0)
                first = self._all_reduce(torch.cat([mean_r * count, count]))
                n = first[-1]
                mean = first[:c] / n
                var = self._all_reduce(count * (var_r + (mean_r - mean) ** 2)) / n
            shape = [1, c] + [1] * (h.dim() - 2)
            out = (h - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps) * gamma.view(shape) + beta.view(shape)
            with torch.no_grad():
                if sem == "tf":
                    rm.copy_(rm * m + mean * (1.0 - m))
                    rv.copy_(rv * m + var * (1.0 - m))
                else:  # SyncBatchNorm's update: torch momentum 1 - m, unbiased with the global count
                    mom = 1.0 - m
                    rm.copy_((1.0 - mom) * rm + mom * mean)
                    rv.copy_((1.0 - mom) * rv + mom * var * (n / (n - 1)))
        out = out.to(out_dtype)
        return out.movedim(1, -1) if channels_last else out

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group, differentiably (its backward all-reduces the gradients, as
        SyncBatchNorm's backward does); ``t`` itself without a group."""
        if self.group is None:
            return t
        with warnings.catch_warnings():
            # deprecated in favour of a private module; it is still the public differentiable allreduce
            warnings.simplefilter("ignore", FutureWarning)
            return dist_fn.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def forward(self, x: torch.Tensor, masks: Mapping[str, torch.Tensor] | None = None, *,
                with_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``[batch, *input_shape]`` (canonical, NHWC for images) -> ``[batch, *output_shape]``.

        ``masks``: layer path (``"3"``, ``"3.body.1"``) -> bool keep-mask ``[batch, *layer_input_shape]`` (canonical).
        With ``with_logits``, also returns the last layer's value before its activation.
        """
        h = x.permute(0, 3, 1, 2) if x.dim() == 4 else x  # NHWC -> NCHW, once
        pre = h
        self._masks = masks  # nested dropout and attention layers read theirs by path (_layer)
        for i, layer in enumerate(self.layers):
            kind = layer["type"]
            if kind == "poly":
                d = layer["degree"]
                powers = torch.arange(d, -1, -1, dtype=h.dtype)
                h = torch.pow(h[:, None], powers)  # x^d ... x, 1
            elif kind == "dense":
                kernel, bias = self._p(i, "kernel"), self._p(i, "bias") if layer["use_bias"] else None
                h = _last_axis(h, _dense(kernel, bias))
                pre = h
                h = _activate(h, layer["activation"], layer)
            elif kind == "conv2d":
                if layer["padding"] == "same":
                    h = _pad_same(h, layer["kernel_size"], layer["strides"], 0.0)
                elif layer["padding"] != "valid":  # explicit [[top, bottom], [left, right]]
                    h = F.pad(h, _pads(h, layer["padding"], layer["kernel_size"], layer["strides"]))
                w = self._p(i, "kernel").permute(3, 2, 0, 1).contiguous()  # HWIO -> OIHW (see _layer)
                h = F.conv2d(h, w, self._p(i, "bias") if layer["use_bias"] else None, stride=tuple(layer["strides"]))
                pre = h
                h = _ACT[layer["activation"]](h)
            elif kind == "max_pool2d":
                if layer["padding"] == "same":
                    h = _pad_same(h, layer["pool_size"], layer["strides"], -math.inf)
                elif layer["padding"] != "valid":
                    h = F.pad(h, _pads(h, layer["padding"], layer["pool_size"], layer["strides"]), value=-math.inf)
                h = F.max_pool2d(h, tuple(layer["pool_size"]), tuple(layer["strides"]))
            elif kind == "flatten":
                h = (h.permute(0, 2, 3, 1) if h.dim() == 4 else h).reshape(h.shape[0], -1)  # NHWC order
            elif kind == "batch_norm":
                h = self._batch_norm(i, layer, h)
            elif kind == "dropout":
                h = self._dropout(str(i), layer, h, masks)
            else:
                h = self._layer(str(i), layer, h)
            self._trace(str(i), h)
        if h.dim() == 4:
            h = h.permute(0, 2, 3, 1)  # back to canonical NHWC
        if pre.dim() == 4:
            pre = pre.permute(0, 2, 3, 1)
        return (h, pre) if with_logits else h
