"""What theory predicts for a pair of implementations on a case.

Two kinds of prediction:

*expected differences* — the two set-ups compute different updates in exact
arithmetic, so the judge must find a divergence (and a parity verdict would
itself be a failure: "unexpected parity");

*known differences* — documented, small effects that are not bugs but can show
up in a float64 comparison (Keras keeping ``learning_rate`` in float32), which
the verdict must name rather than hide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Prediction", "predict", "is_parallel", "uneven_shards", "keras_rounds_hyperparameters", "KERAS_IMPLS"]

PARALLEL = ("tf.towers", "torch.ddp")


@dataclass(frozen=True)
class Prediction:
    """``expected``: causes of a predicted divergence; ``known``: documented small effects."""

    expected: tuple[str, ...]
    known: tuple[str, ...]

    @property
    def differ(self) -> bool:
        return bool(self.expected)


def is_parallel(impl: str) -> bool:
    return impl in PARALLEL


def _sizes(spec: dict[str, Any]) -> list[int]:
    b, n = spec["data"]["global_batch"], spec["parallel"]["devices"]
    if spec["parallel"]["shard"] == "strided":
        return [len(range(r, b, n)) for r in range(n)]
    return [b // n + (1 if r < b % n else 0) for r in range(n)]


def uneven_shards(spec: dict[str, Any]) -> bool:
    """True when the global batch does not divide evenly across the devices."""
    return len(set(_sizes(spec))) > 1


def _framework(impl: str) -> str:
    return impl.split(".")[0]


def predict(spec: dict[str, Any], a: str, b: str) -> Prediction:
    """Predicted differences between implementations ``a`` and ``b`` on a validated case."""
    expected: list[str] = []
    known: list[str] = []
    par = spec["parallel"]
    n = par["devices"]
    one_parallel = is_parallel(a) != is_parallel(b) and n > 1
    if one_parallel:
        if spec["model"]["reduction"] == "sum":
            expected.append(
                f"sum reduction: {n} devices average per-device sums, i.e. the full-batch sum / {n}"
            )
        elif par["weighting"] == "equal" and uneven_shards(spec):
            expected.append(
                "uneven shards with equal weighting: the device mean weights rows of smaller shards more"
            )
    opt = spec["optimizer"]
    fa, fb = _framework(a), _framework(b)
    if opt["semantics"] == "native" and fa != fb:
        if opt["name"] == "adam":
            expected.append(
                "Adam epsilon placement: Keras adds eps to sqrt(v), torch to sqrt(v)/sqrt(1-beta2^t)"
            )
        if spec["dtype"] == "float64":
            known.append(
                "Keras rounds learning_rate, momentum and Adam's bias-correction betas to float32 in a float64 run"
            )
    return Prediction(tuple(expected), tuple(known))


KERAS_IMPLS = ("tf.towers", "tf.single", "tf.mirrored")


def keras_rounds_hyperparameters(spec: dict[str, Any], a: str, b: str) -> str | None:
    """The implementation to run with Keras' float32-rounded hyperparameters, or ``None``.

    In a float64 ``native`` run, Keras 3 rounds ``learning_rate`` and ``momentum``
    to float32 (measured: that rounding reproduces Keras' SGD to the last bit).
    For SGD and momentum this is the whole difference from the other framework's
    rule, so it can be mapped exactly: the non-Keras side runs with the same
    rounded values. (Adam's betas are rounded only inside Keras' bias
    correction, which no hyperparameter of torch's rule can reproduce; native
    Adam differs by its epsilon placement anyway.)
    """
    opt = spec["optimizer"]
    if spec["dtype"] != "float64" or opt["semantics"] != "native" or opt["name"] not in ("sgd", "momentum"):
        return None
    ka, kb = a in KERAS_IMPLS, b in KERAS_IMPLS
    if ka == kb:
        return None
    return b if ka else a
