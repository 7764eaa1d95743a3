"""The error an implementation raises for a valid case it does not implement."""

from __future__ import annotations

from parity_tests.protocol.errors import TfparError
from parity_tests.protocol.specs import nested_layers

__all__ = ["Unsupported", "refuse_loss_options", "refuse_unimplemented"]


class Unsupported(TfparError, ValueError):
    """A case field this implementation does not implement (the caller reports it as bad input).

    Args:
        field: the case field, e.g. ``"parallel.clip"``.
        expected: what this implementation accepts, e.g. ``"local for tf.v1 (... tf.towers has sync)"``.
    """

    def __init__(self, field: str, expected: str) -> None:
        self.field, self.expected = field, expected
        super().__init__(f"{field}: {expected}")


def refuse_unimplemented(spec: dict, impl: str, *, optimizers: tuple[str, ...] | None = None,
                         schedules: bool = True, weight_decay: bool = True, clip: bool = False,
                         layers: bool = False, loss_options: bool = False) -> None:
    """Refuse, naming the field, what a path other than ``tf.towers`` does not implement.

    ``optimizers`` (when given) limits the optimizer names; the flags say
    whether the path implements learning-rate ``schedules``, ``weight_decay``,
    gradient clipping (``clip``), batch-norm and dropout ``layers``, and the
    ``loss_options`` (class and sample weights, label smoothing, probability
    inputs, a mapped loss formula).
    """
    opt = spec["optimizer"]
    if optimizers is not None and opt["name"] not in optimizers:
        names = ", ".join(optimizers[:-1]) + " or " + optimizers[-1] if len(optimizers) > 1 else optimizers[0]
        raise Unsupported("optimizer.name", f"{names} for {impl}, got {opt['name']!r}")
    if not schedules and opt.get("schedule", {"kind": "constant"})["kind"] != "constant":
        raise Unsupported("optimizer.schedule", f"a constant learning rate for {impl}, got {opt['schedule']['kind']!r}")
    if not weight_decay and opt.get("weight_decay"):
        raise Unsupported("optimizer.weight_decay", f"no weight decay for {impl} (tf.towers has it)")
    if not clip and spec["parallel"].get("clip") is not None:
        raise Unsupported("parallel.clip", f"no gradient clipping for {impl} (tf.towers has it)")
    if not loss_options:
        refuse_loss_options(spec, impl)
    for path, layer in nested_layers(spec["model"]["layers"]):
        if not layers and layer["type"] in ("batch_norm", "dropout"):
            where = f"model.layers[{path[0]}]" + "".join(f".{f}[{j}]" for f, j in zip(path[1::2], path[2::2], strict=True))
            raise Unsupported(f"{where}.type",
                              f"no {layer['type']} layer for {impl} (tf.towers has it)")


def refuse_loss_options(spec: dict, impl: str) -> None:
    """Refuse the model's loss options (class weights, label smoothing, probability inputs,
    a non-native loss formula) for a path that computes only the plain loss of ``tfpar.losses.device_loss``."""
    model = spec["model"]
    if spec["data"].get("sample_weights") is not None:
        raise Unsupported("data.sample_weights", f"none for {impl} (tf.towers has sample weights)")
    if model.get("class_weights") is not None:
        raise Unsupported("model.class_weights", f"null for {impl} (tf.towers has class weights)")
    if model.get("label_smoothing", 0.0):
        raise Unsupported("model.label_smoothing", f"0 for {impl} (tf.towers has label smoothing)")
    if not model.get("from_logits", True):
        raise Unsupported("model.from_logits", f"true for {impl} (tf.towers takes probabilities)")
    if model.get("loss_semantics", "native") != "native":
        raise Unsupported("model.loss_semantics", f"native for {impl} (tf.towers has the mapped loss formulas)")
