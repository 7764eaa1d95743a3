"""Validation of the ``parallel`` section: devices, combine rule, sharding, weighting.

Combine rules (``docs/combine-rules.md``): ``grad_mean`` and ``loss_mean`` apply one
combined gradient per step; ``param_mean`` (with ``period``) and ``async`` (with
``staleness`` and ``order_seed``) let every device apply its own updates.
"""

from __future__ import annotations

from typing import Any

from parity_tests.contract.fields import choice, integer, need, no_extra, number, obj
from parity_tests.contract.model import nested_layers
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.shards import shard_sizes
from parity_tests.protocol.vocabulary import ALL_COMBINES, COMBINES, LOCAL_COMBINES

__all__ = ["COMBINES", "LOCAL_COMBINES", "ALL_COMBINES", "SHARDS", "WEIGHTINGS", "BATCH_NORMS", "CLIP_PLACES",
           "MAX_DEVICES", "MAX_ACCUMULATE", "validate_parallel", "check_accumulate", "validate_clip", "check_combine_model"]

SHARDS = ("contiguous", "strided")
#: ``sum``: every device's loss weighted 1 (with a ``sum`` reduction, the full-batch sum: what one
#: device computes); grad_mean and loss_mean only. The judge maps a predicted sum reduction with it.
WEIGHTINGS = ("equal", "by_size", "sum")
BATCH_NORMS = ("local", "sync")
CLIP_PLACES = ("after_combine", "per_device")
MAX_DEVICES = 64
MAX_ACCUMULATE = 10_000


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
    if where == "after_combine" and combine in LOCAL_COMBINES:
        raise CaseError("parallel.clip.where", f"per_device with combine {combine} (every device applies its own"
                        " gradient: there is no combined gradient to clip)", where)
    return {"global_norm": norm, "where": where}


# field -> the combine rule it belongs to; all default to the values in _local_fields
_LOCAL_FIELDS = {"period": "param_mean", "staleness": "async", "order_seed": "async"}


def _local_fields(p: dict, combine: str) -> dict:
    """``period`` (param_mean: local steps between averages, >= 1, default 1); ``staleness``
    (async: how many of the step's earlier applications a device's read may miss, >= 0,
    default 0) and ``order_seed`` (async: seed of the per-step application orders, default 0).

    Each is an error with any other combine rule (it would be silently ignored), and the
    normalised spec carries them only for their rule, so other cases keep their spec.
    """
    for field, rule in _LOCAL_FIELDS.items():
        if field in p and combine != rule:
            raise CaseError(f"parallel.{field}", f"no such field with combine {combine} (it belongs to combine {rule})")
    if combine == "param_mean":
        return {"period": integer(p.get("period", 1), "parallel.period", 1, 100_000)}
    if combine == "async":
        return {"staleness": integer(p.get("staleness", 0), "parallel.staleness", 0, 100_000),
                "order_seed": integer(p.get("order_seed", 0), "parallel.order_seed", 0, 2**32 - 1)}
    return {}


def check_combine_model(parallel: dict, layers: list[dict], data: Any = None) -> None:
    """Cross-checks for param_mean and async, against the model and the (raw) data section.

    Batch norm: param_mean and async do not define how moving statistics combine (each
    device would keep its own, and neither torch's model averager, which averages
    ``parameters()`` only, nor an asynchronous server has a rule for them).
    ``data.order``: both read step k's global batch split as ``parallel.shard`` says.
    """
    combine = parallel["combine"]
    if combine not in LOCAL_COMBINES:
        return
    bn = [".".join(map(str, path)) for path, layer in nested_layers(layers) if layer["type"] == "batch_norm"]
    if bn:
        raise CaseError("parallel.combine", f"grad_mean or loss_mean for a model with batch_norm layers (layer {bn[0]});"
                        " param_mean and async do not define how moving statistics combine", combine)
    order = data.get("order", "split") if isinstance(data, dict) else "split"
    if order != "split":
        raise CaseError("data.order", f"split with combine {combine} (each device reads its shard of step k's"
                        " global batch)", order)


def check_accumulate(parallel: dict, batch: int, order: str) -> None:
    """``parallel.accumulate: k``: every device's shard of a global batch is cut into k equal contiguous
    micro-batches, so each shard's rows must be a multiple of k (and ``data.order: split``: an epoch's
    shorter last batch under ``distributed_sampler`` would change the micro-batch size)."""
    k = parallel.get("accumulate", 1)
    if k == 1:
        return
    if order != "split":
        raise CaseError("parallel.accumulate", f"1 with data.order {order} (an epoch's last batch is shorter;"
                        " accumulation cuts equal micro-batches)", k)
    sizes = shard_sizes(batch, parallel["devices"], parallel["shard"])
    if any(s % k for s in sizes):
        raise CaseError("parallel.accumulate", f"a divisor of every device's rows per step (global_batch {batch} over"
                        f" {parallel['devices']} devices gives {sorted(set(sizes))}): each shard is cut into"
                        " that many equal micro-batches", k)


def validate_parallel(p: Any) -> dict:
    """The ``parallel`` section, normalised (defaults filled in); see the module docstring."""
    p = obj(p, "parallel")
    no_extra(p, {"devices", "combine", "shard", "weighting", "clip", "batch_norm", "accumulate", *_LOCAL_FIELDS},
             "parallel")
    out = {
        "devices": integer(need(p, "devices", "parallel"), "parallel.devices", 1, MAX_DEVICES),
        "combine": choice(p.get("combine", "grad_mean"), "parallel.combine", ALL_COMBINES),
        "shard": choice(p.get("shard", "contiguous"), "parallel.shard", SHARDS),
        "weighting": choice(p.get("weighting", "equal"), "parallel.weighting", WEIGHTINGS),
    }
    # local (the default; DDP's): each device normalises with its own shard's statistics;
    # sync: statistics over all devices (SyncBatchNorm). Carried only when given, so
    # older cases keep their spec; readers use .get("batch_norm", "local").
    if "batch_norm" in p:
        out["batch_norm"] = choice(p["batch_norm"], "parallel.batch_norm", BATCH_NORMS)
        if out["batch_norm"] == "sync" and out["combine"] in LOCAL_COMBINES:
            raise CaseError("parallel.batch_norm", f"local with combine {out['combine']} (devices do not run in"
                            " lockstep, so there are no shared statistics)", "sync")
    # micro-batches per optimizer step (docs/case-format.md); carried only when given, as batch_norm
    if "accumulate" in p:
        out["accumulate"] = integer(p["accumulate"], "parallel.accumulate", 1, MAX_ACCUMULATE)
        if out["accumulate"] > 1 and out["combine"] in LOCAL_COMBINES:
            raise CaseError("parallel.accumulate", f"1 with combine {out['combine']} (accumulation is defined for"
                            " the combines that apply one combined gradient per step: grad_mean, loss_mean)",
                            out["accumulate"])
    if out["weighting"] == "sum" and out["combine"] in LOCAL_COMBINES:
        raise CaseError("parallel.weighting", f"equal or by_size with combine {out['combine']} (each device applies"
                        " its own update: weights average the copies and sum to 1)", "sum")
    out.update(_local_fields(p, out["combine"]))
    # absent (or null) means no clipping; only a clipping case carries the key
    if p.get("clip") is not None:
        out["clip"] = validate_clip(p["clip"], out["combine"])
    return out
