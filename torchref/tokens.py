"""The GPT input/output path in torch: token inputs, ``embedding``, ``tied_logits``, per-token cross entropy.

Each computes what the torch class computes (``docs/layers.md``, "Token layers"); pinned by
``parity_tests/tests/test_layers_tokens.py``:

embedding
    ``F.embedding(ids, embeddings)`` (``nn.Embedding``, ``sparse=False``): ``[B, ...] -> [B, ..., D]``,
    a dense gradient (a looked-up row's gradient is ``G = sum_i g_i`` over its occurrences).
    ``gradient`` (``native``/``dense``) is TensorFlow's choice; torch's gradient is dense either way.
tied_logits
    ``h @ embeddings.T``: ``[..., D] -> [..., V]`` (GPT-2's tied ``lm_head``); the table's
    gradient sums both uses.
per-token softmax_ce
    logits ``[n, ..., k]`` and labels ``[n, ...]`` flattened to ``[m, k]``, ``[m]`` (``F.cross_entropy``
    wants the classes on dim 1); ``ignore_label`` c: ``F.cross_entropy(ignore_index=c)``, ``mean``
    = the sum over labelled positions / their count (NaN with none: the case refuses that).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["TOKEN_LAYERS", "embed", "tied_logits", "flatten_tokens", "ignore_label_ce", "inputs"]

TOKEN_LAYERS = ("embedding", "tied_logits")


def embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[ids]``: int64 ``[B, ...]`` and ``[V, D]`` -> ``[B, ..., D]`` (``nn.Embedding``'s function)."""
    return F.embedding(ids, table)


def tied_logits(h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``h @ table.T``: ``[B, ..., D]`` -> ``[B, ..., V]``."""
    return h @ table.T


def flatten_tokens(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logits ``[n, ..., k]`` and labels ``[n, ...]`` as ``[m, k]`` and ``[m]``."""
    if out.dim() <= 2:
        return out, y
    return out.reshape(-1, out.shape[-1]), y.reshape(-1)


def ignore_label_ce(out: torch.Tensor, y: torch.Tensor, label: int, reduction: str) -> torch.Tensor:
    """``F.cross_entropy(out, y, ignore_index=label, reduction=...)`` on ``[m, k]`` logits."""
    return F.cross_entropy(out, y, ignore_index=int(label), reduction=reduction)


def inputs(x: Any, dtype: torch.dtype) -> torch.Tensor:
    """The case's ``x`` as a tensor: integer token ids as int64 (``nn.Embedding`` wants them), else ``dtype``."""
    a = np.asarray(x)
    return torch.as_tensor(a.astype(np.int64)) if a.dtype.kind in "iu" else torch.as_tensor(a, dtype=dtype)


def layer(kind: str, spec: Mapping[str, Any], param, path: str, h: torch.Tensor) -> torch.Tensor:
    """``embedding`` or ``tied_logits`` at ``path``; ``param(path, kind)`` reads a parameter."""
    if kind == "embedding":
        return embed(h, param(path, "embeddings"))
    return tied_logits(h, param(spec["embedding"], "embeddings"))
