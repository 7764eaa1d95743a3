"""What each TensorFlow engine refuses of a case, decided from the spec alone (framework-free: no TensorFlow).

One place for every refusal a TensorFlow engine makes before it trains, so that the
harness can ask every named implementation before it runs any of them
(``parity_tests.running.harness.refuse``): a ``compare`` whose third implementation
refuses the case says so at once, not after the first two have run. The engines call
the same functions at the start of their own runs (``tfpar.run.run_case``, ``run_v1``,
``run_mirrored``, ``run_multiworker``), so a refusal is written once.

What is not decided here is what needs the running process: how many TensorFlow
devices it can make (``parity_tests.running.backends.check_tf_devices``) and
``tf.multiworker``'s cluster description (``tfpar.multiworker.Cluster``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from parity_tests.protocol.specs import nested_layers
from parity_tests.protocol.vocabulary import LOCAL_COMBINES

from .engines import SPECS, by_name
from .errors import Unsupported, refuse_unimplemented

__all__ = ["refuse", "refuse_declared", "refuse_v1", "refuse_mirrored", "refuse_multiworker"]


def _runs_on(runs: Callable[[Any], bool]) -> str:
    """``"tf.towers and tf.single"``: the in-process engines whose declaration ``runs`` accepts."""
    names = [s.name for s in SPECS if s.in_process and runs(s)]
    return " and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1]


def refuse_declared(spec: Mapping[str, Any], impl: str) -> bool:
    """Refuse what ``impl``'s declaration (``tfpar.engines``) leaves out: ``data.order``, ``parallel.combine``,
    ``parallel.accumulate``, ``dtype``; ``False`` where ``run_case`` hands the case to the local-update
    runners (``param_mean``, ``async``: nothing more is refused), ``True`` otherwise.

    Raises:
        Unsupported: naming the field and the engines that run it.
    """
    declared = by_name(impl)
    order = spec["data"].get("order", "split")
    if order not in declared.orders:
        raise Unsupported("data.order", f"{' or '.join(declared.orders)} for {impl} (data.order {order} runs on"
                                        f" {_runs_on(lambda s: order in s.orders)})")
    combine = spec["parallel"]["combine"]
    if combine not in declared.combines:
        raise Unsupported("parallel.combine", f"{' or '.join(declared.combines)} for {impl} ({combine} runs on"
                                              f" {_runs_on(lambda s: combine in s.combines)})")
    if spec["parallel"].get("accumulate", 1) > 1 and not declared.accumulate:
        raise Unsupported("parallel.accumulate", f"1 for {impl} (micro-batch accumulation runs on"
                                                 f" {_runs_on(lambda s: s.accumulate)})")
    if combine in LOCAL_COMBINES and impl != "tf.single":  # tf.single: one device, where every rule is the same
        return False
    if spec["dtype"] not in declared.dtypes:  # Keras' mixed_bfloat16 policy: tfpar.models
        raise Unsupported("dtype", f"{' or '.join(declared.dtypes)} for {impl} ({spec['dtype']} runs on"
                                   f" {_runs_on(lambda s: spec['dtype'] in s.dtypes)})")
    return True


def refuse_v1(spec: Mapping[str, Any]) -> None:
    """Refuse what the v1 runner does not implement, naming the case field.

    Raises:
        Unsupported: naming the field, for an optimizer other than sgd,
            momentum or adam, a learning-rate schedule, weight decay, or
            ``parallel.batch_norm: sync`` (the classic towers normalise each
            tower with its own statistics).
    """
    refuse_unimplemented(spec, "tf.v1", optimizers=by_name("tf.v1").optimizers, schedules=False, weight_decay=False,
                         clip=True, layers=True, loss_options=True)
    has_bn = any(layer["type"] == "batch_norm" for _, layer in nested_layers(spec["model"]["layers"]))
    if has_bn and spec["parallel"].get("accumulate", 1) > 1:
        raise Unsupported("parallel.accumulate", "1 for tf.v1 with batch norm (the k moving-statistics updates of a"
                          " step would need chaining by control dependencies; tf.towers and tf.mirrored accumulate"
                          " with batch norm)")
    if has_bn and spec["parallel"].get("batch_norm", "local") == "sync":
        raise Unsupported("parallel.batch_norm", "local for tf.v1 (the classic towers normalise each tower with its"
                          " own shard's statistics; tf.towers has sync)")


def refuse_mirrored(spec: Mapping[str, Any]) -> None:
    """Refuse what the MirroredStrategy runner does not implement, naming the case field.

    Every optimizer, schedule, weight decay, clipping, layer, loss option and
    sample weighting of ``tf.towers`` works; nothing is refused at present
    beyond what :func:`tfpar.errors.refuse_unimplemented` is told to.
    """
    refuse_unimplemented(spec, "tf.mirrored", clip=True, layers=True, loss_options=True)


def refuse_multiworker(spec: Mapping[str, Any]) -> None:
    """Refuse what the multi-worker runner does not implement, naming the case field.

    Everything ``tf.mirrored`` runs, except ``model.placement`` (layers pinned to tower
    devices: a worker has only its own devices).
    """
    refuse_unimplemented(spec, "tf.multiworker", clip=True, layers=True, loss_options=True)
    if spec["model"].get("placement"):
        raise Unsupported("model.placement", "none for tf.multiworker (a worker holds only its own devices;"
                                             " tf.towers places layers)")
    order = spec["data"].get("order", "split")
    if order != "split":
        raise Unsupported("data.order", f"split for tf.multiworker (data.order {order} runs on tf.towers and tf.single)")
    if spec["parallel"]["combine"] not in ("grad_mean", "loss_mean"):
        raise Unsupported("parallel.combine", f"grad_mean or loss_mean for tf.multiworker"
                                              f" ({spec['parallel']['combine']} runs on tf.towers)")


_ENGINE = {"tf.v1": refuse_v1, "tf.mirrored": refuse_mirrored}


def refuse(spec: Mapping[str, Any], impl: str) -> None:
    """Everything ``tfpar.run_case(payload, impl)`` refuses of ``spec`` before it trains, in the same order.

    ``impl``: an in-process TensorFlow engine (``tf.towers``, ``tf.single``, ``tf.v1``, ``tf.mirrored``);
    ``tf.multiworker``'s own refusals are :func:`refuse_multiworker`.

    Raises:
        Unsupported: the first field ``impl`` does not implement.
    """
    if impl == "tf.multiworker":
        refuse_multiworker(spec)
        return
    if refuse_declared(spec, impl) and impl in _ENGINE:
        _ENGINE[impl](spec)
