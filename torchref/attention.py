"""Self-attention as torch's ``nn.MultiheadAttention`` computes it, on canonical (Keras-layout) parameters.

The boundary conversion (docs/layers.md, "Attention"): ``q.kernel [D, H, dk]`` is ``Wq.reshape(D, H*dk)``,
whose transpose is the q block of ``in_proj_weight [3E, E]`` (head ``h`` is rows ``h*dk ... (h+1)*dk - 1``,
as in Keras' reshape); ``q.bias [H, dk]`` flattens to the q block of ``in_proj_bias``; ``o.kernel [H, dv, D]``
reshaped ``[H*dv, D]`` is ``out_proj.weight.T``. The projections are ``F.linear`` with those blocks, as
``F.multi_head_attention_forward`` applies ``in_proj`` (one ``linear`` per block when query, key and value are
the same tensor's views); separate blocks also express ``H*key_dim != D`` and ``value_dim != key_dim``,
which the class cannot.

Then, per head (``[n, H, T, dk]``):

* ``dropout == 0``: ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``, the class's
  ``need_weights=False`` path (functional.py 7077), scale ``1/sqrt(dk)`` (its default);
* ``dropout > 0``: the class's ``need_weights=True`` path (functional.py 7024-7047): ``q * sqrt(1/dk)``
  (Python double), ``bmm`` with ``k^T``, the causal mask as ``-inf`` (a bool ``attn_mask``: ``True``
  blocks), ``softmax``, dropout as ``F.dropout`` computes it with the case's keep-mask
  (``w * keep / (1 - p)``), ``bmm`` with ``v``.

``semantics: tf`` uses Keras' scale, ``float32(1/sqrt(key_dim))`` (TensorFlow's ``tf.cast`` of a Python
float goes through float32), so both sides compute TensorFlow's function in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["attention", "attention_scale", "refuse_fully_masked"]


def attention_scale(key_dim: int, semantics: str = "native") -> float:
    """The logits' scale: torch's ``math.sqrt(1.0 / key_dim)``, or Keras' float32-rounded one under ``tf``."""
    if semantics == "tf":
        return float(np.float32(1.0 / math.sqrt(float(key_dim))))
    return math.sqrt(1.0 / float(key_dim))


def refuse_fully_masked(blocked: torch.Tensor, path: str) -> torch.Tensor:
    """``blocked`` (``[T, S]``, ``True`` blocks: torch's sense), refused in one line when a query row blocks every key.

    No case can build one (``parity_tests.contract.attention``); kept as a guard: torch's softmax
    over a row of ``-inf`` is NaN.
    """
    empty = torch.nonzero(blocked.all(dim=-1)).flatten()
    if empty.numel():
        raise ValueError(f"layer {path}: attention query row(s) {empty.tolist()} attend to no key (every key masked);"
                         " Keras gives such a row uniform or zero weights and torch NaN, so it is refused")
    return blocked


def _causal(t: int, path: str) -> torch.Tensor:
    """``[T, T]`` bool, ``True`` where key ``j > i`` is blocked (torch's sense)."""
    return refuse_fully_masked(torch.ones(t, t, dtype=torch.bool).triu(1), path)


def attention(path: str, layer: dict, p: Callable[[str], torch.Tensor], h: torch.Tensor,
              keep: torch.Tensor | None) -> torch.Tensor:
    """Attention layer ``path`` on tokens ``h`` ``[n, T, D]`` -> ``[n, T, D]``.

    ``p(name)``: the canonical parameter ``<path>.<name>`` (``q.kernel``...); ``keep``: the dropout
    keep-mask ``[n, H, T, T]`` when ``layer["dropout"] > 0``.
    """
    n, t, d = h.shape
    heads, bias = layer["num_heads"], layer["use_bias"]

    def project(name: str) -> torch.Tensor:  # [n, H, T, width]
        kernel = p(f"{name}.kernel")
        width = kernel.shape[-1]
        out = F.linear(h, kernel.reshape(d, heads * width).T, p(f"{name}.bias").reshape(-1) if bias else None)
        return out.view(n, t, heads, width).transpose(1, 2)

    if layer["key_dim"] == layer["value_dim"] and heads * layer["key_dim"] == d:
        q, k, v = _packed(p, h, heads, bias)  # what nn.MultiheadAttention can express: its own layout, op for op
    else:
        q, k, v = project("q"), project("k"), project("v")
    scale = attention_scale(layer["key_dim"], layer["semantics"])
    blocked = _causal(t, path) if layer["causal"] else None
    if layer["dropout"] == 0.0:
        explicit = None if layer["semantics"] != "tf" else scale  # torch's default scale is its own
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=layer["causal"], scale=explicit)
    else:
        if keep is None:
            raise ValueError(f"layer {path}: an attention layer with dropout needs its keep-mask (payload['masks'][{path!r}])")
        weights = torch.matmul(q * scale, k.transpose(-2, -1))
        if blocked is not None:
            weights = weights.masked_fill(blocked, -math.inf)
        weights = torch.softmax(weights, dim=-1)
        weights = weights * (keep.to(weights.dtype) / (1.0 - layer["dropout"]))  # F.dropout's arithmetic
        mixed = torch.matmul(weights, v)
    wo = p("o.kernel")
    # [n, H, T, dv] -> [T, n, H*dv] -> [T*n, H*dv], the class's out_proj input (functional.py 7087-7090)
    mixed = mixed.permute(2, 0, 1, 3).contiguous().view(t * n, -1)
    out = F.linear(mixed, wo.reshape(-1, d).T, p("o.bias") if bias else None)
    return out.view(t, n, d).transpose(0, 1)


def _packed(p: Callable[[str], torch.Tensor], h: torch.Tensor, heads: int,
            bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[n, H, T, dk]`` as ``nn.MultiheadAttention(batch_first=True)`` makes them from one tensor.

    The class turns the batch time-major (``[T, n, E]``), applies the packed ``in_proj`` as one
    ``linear`` (``_in_projection_packed``: query, key and value are the same tensor) and splits it;
    the layout decides how the kernel blocks its sums, which bfloat16 results show (one ulp of the
    projection), so this follows it rather than three ``linear`` calls on the batch-first tensor.
    """
    n, t, d = h.shape
    w = torch.cat([p(f"{m}.kernel").reshape(d, d) for m in "qkv"], 1).T  # in_proj_weight [3E, E]
    b = torch.cat([p(f"{m}.bias").reshape(d) for m in "qkv"]) if bias else None
    proj = F.linear(h.transpose(0, 1), w, b)  # [T, n, 3E]
    proj = proj.unflatten(-1, (3, d)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    dk = d // heads
    return tuple(x.view(t, n * heads, dk).transpose(0, 1).view(n, heads, t, dk) for x in (proj[0], proj[1], proj[2]))
