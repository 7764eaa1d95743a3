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

__all__ = ["Prediction", "predict", "is_parallel", "uneven_shards"]

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
