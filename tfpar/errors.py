"""The error an implementation raises for a valid case it does not implement."""

from __future__ import annotations

__all__ = ["Unsupported", "refuse_loss_options"]


class Unsupported(ValueError):
    """A case field this implementation does not implement (the caller reports it as bad input).

    Args:
        field: the case field, e.g. ``"parallel.clip"``.
        expected: what this implementation accepts, e.g. ``"no gradient clipping for tf.v1 (tf.towers has it)"``.
    """

    def __init__(self, field: str, expected: str) -> None:
        self.field, self.expected = field, expected
        super().__init__(f"{field}: {expected}")


def refuse_loss_options(spec: dict, impl: str) -> None:
    """Refuse the model's loss options (class weights, label smoothing, probability inputs,
    a non-native loss formula) for a path that computes only the plain loss of ``tfpar.losses.device_loss``."""
    model = spec["model"]
    if model.get("class_weights") is not None:
        raise Unsupported("model.class_weights", f"null for {impl} (tf.towers has class weights)")
    if model.get("label_smoothing", 0.0):
        raise Unsupported("model.label_smoothing", f"0 for {impl} (tf.towers has label smoothing)")
    if not model.get("from_logits", True):
        raise Unsupported("model.from_logits", f"true for {impl} (tf.towers takes probabilities)")
    if model.get("loss_semantics", "native") != "native":
        raise Unsupported("model.loss_semantics", f"native for {impl} (tf.towers has the mapped loss formulas)")
