"""Validation of the ``parallel`` section: devices, combine rule, sharding, weighting."""

from __future__ import annotations

from typing import Any

from .fields import choice, integer, need, no_extra, obj

__all__ = ["COMBINES", "SHARDS", "WEIGHTINGS", "MAX_DEVICES", "validate_parallel"]

COMBINES = ("grad_mean", "loss_mean")
SHARDS = ("contiguous", "strided")
WEIGHTINGS = ("equal", "by_size")
MAX_DEVICES = 64

def validate_parallel(p: Any) -> dict:
    p = obj(p, "parallel")
    no_extra(p, {"devices", "combine", "shard", "weighting"}, "parallel")
    return {
        "devices": integer(need(p, "devices", "parallel"), "parallel.devices", 1, MAX_DEVICES),
        "combine": choice(p.get("combine", "grad_mean"), "parallel.combine", COMBINES),
        "shard": choice(p.get("shard", "contiguous"), "parallel.shard", SHARDS),
        "weighting": choice(p.get("weighting", "equal"), "parallel.weighting", WEIGHTINGS),
    }
