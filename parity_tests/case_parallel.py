"""Validation of the ``parallel`` section: devices, combine rule, sharding, weighting."""

from __future__ import annotations

from typing import Any

from .errors import CaseError
from .fields import choice, integer, need, no_extra, number, obj

__all__ = ["COMBINES", "SHARDS", "WEIGHTINGS", "BATCH_NORMS", "CLIP_PLACES", "MAX_DEVICES", "validate_parallel", "validate_clip"]

COMBINES = ("grad_mean", "loss_mean")
SHARDS = ("contiguous", "strided")
WEIGHTINGS = ("equal", "by_size")
BATCH_NORMS = ("local", "sync")
CLIP_PLACES = ("after_combine", "per_device")
MAX_DEVICES = 64


def validate_clip(c: Any, combine: str) -> dict:
    """``parallel.clip``: ``{"global_norm": c > 0, "where": "after_combine" (default) | "per_device"}``.

    ``after_combine`` clips the combined gradient (torch's usual order: after
    DDP's allreduce); ``per_device`` clips each device's gradient before they are
    averaged (the classic TF tower order), which needs per-device gradients:
    ``combine: grad_mean``. The clipping formula follows ``optimizer.semantics``
    (see ``docs/optimizers.md``).
    """
    c = obj(c, "parallel.clip")
    no_extra(c, {"global_norm", "where"}, "parallel.clip")
    norm = number(need(c, "global_norm", "parallel.clip"), "parallel.clip.global_norm", lo=0.0, lo_open=True)
    where = choice(c.get("where", "after_combine"), "parallel.clip.where", CLIP_PLACES)
    if where == "per_device" and combine == "loss_mean":
        raise CaseError("parallel.clip.where", "after_combine with combine loss_mean (it has no per-device gradient to clip)",
                        where)
    return {"global_norm": norm, "where": where}


def validate_parallel(p: Any) -> dict:
    p = obj(p, "parallel")
    no_extra(p, {"devices", "combine", "shard", "weighting", "clip", "batch_norm"}, "parallel")
    out = {
        "devices": integer(need(p, "devices", "parallel"), "parallel.devices", 1, MAX_DEVICES),
        "combine": choice(p.get("combine", "grad_mean"), "parallel.combine", COMBINES),
        "shard": choice(p.get("shard", "contiguous"), "parallel.shard", SHARDS),
        "weighting": choice(p.get("weighting", "equal"), "parallel.weighting", WEIGHTINGS),
    }
    # local (the default; DDP's): each device normalises with its own shard's statistics;
    # sync: statistics over all devices (SyncBatchNorm). Carried only when given, so
    # older cases keep their spec; readers use .get("batch_norm", "local").
    if "batch_norm" in p:
        out["batch_norm"] = choice(p["batch_norm"], "parallel.batch_norm", BATCH_NORMS)
    # absent (or null) means no clipping; only a clipping case carries the key
    if p.get("clip") is not None:
        out["clip"] = validate_clip(p["clip"], out["combine"])
    return out
