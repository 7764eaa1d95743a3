"""Keras' distribution loss scale, read from each run and mapped on the program itself.

``model.fit`` (and every ``compute_loss``) under a ``tf.distribute`` strategy of N replicas
multiplies each replica's loss by ``keras.ops.cast(1.0 / N, dtype)``, which passes float32
(Keras 3.15.1, ``keras/src/losses/loss.py`` ``scale_loss_for_distribution``): in a float64 run the
loss, the logged loss and every gradient are ``float32(1/N) N`` times the exact ones, ``1 + 2^-25``
at N = 3 (nothing at N a power of two). A port that divides by N in float64 does not carry it
(docs/framework-differences.md, "Keras' distribution loss scale").

No field of the case expresses a precision Keras picks inside ``fit``, so no built-in or stand-in can
be run with it; instead the program is rerun as it is, with that one factor made exact
(``tfpar.keras_seen.keras_loss_scales_seen(exact=True)``, asked through the payload key
``protocol.payload.EXACT_LOSS_SCALE``): the rerun computes what the program computes apart from the
mapped difference by construction, so the pair's residual is the rerun against the other side, and
a bug of the program (a learning rate off by 1e-3, a loss scaled by 1/N twice) is still in it.

Where another mapping runs a built-in standing in for the program and that stand-in is shown not to
compute what the program computes (``comparison.stand_in_leg``: "residual not judged"), the loss scale
stays mapped on the program itself (:func:`without_loss_scale`): the pair's exact reruns against each
other are its residual where they agree; where they part, the pair is resolved by the stage where the
exact reruns part, against the prediction without the loss scale (which those runs no longer carry),
so a predicted loss scale of ``2^-25`` never explains a loss that parts by 0.667 (a loss divided by N
twice). The free compare (``judge_pair._Judged.pair``) and ``--lockstep`` (``lockstep._judge_steps``)
apply the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from parity_tests.contract.case import Case
from parity_tests.judging.theory import LOSS_SCALE, Prediction
from parity_tests.protocol.hyper import keras_scale_factor
from parity_tests.protocol.payload import EXACT_LOSS_SCALE
from parity_tests.session.keys import FLOAT64, RunKey

__all__ = ["EXACT_SCALE", "ExactScale", "ExactScaleCase", "loss_scale_of", "loss_scales", "without_loss_scale"]

#: the trajectory key suffix of a program's rerun with Keras' distribution loss scale exact
EXACT_SCALE = "+exact-loss-scale"


def loss_scale_of(traj: Any) -> float | None:
    """``float32(1/N) N``, the factor a run's float64 losses and gradients carry (``None``: exact, or not a Keras run)."""
    return keras_scale_factor(getattr(traj, "meta", {}).get("keras_loss_scales"))


def loss_scales(impls: list[str], trajs: Mapping[RunKey, Any]) -> dict[str, float | None]:
    """:func:`loss_scale_of` each implementation's float64 run (the run whose numbers decide a float32 case too).

    An implementation without a float64 run (a float32-only plugin) carries nothing a float32 rule
    could tell from float32 arithmetic, whose float32(1/N) it is: ``None``.
    """
    return {impl: loss_scale_of(trajs.get(RunKey(impl, FLOAT64), {})) for impl in impls}


@dataclasses.dataclass
class ExactScaleCase(Case):
    """A case whose TensorFlow plugin run makes Keras' distribution loss scale exact (its payload says so)."""

    def payload(self) -> dict[str, Any]:
        return {**super().payload(), EXACT_LOSS_SCALE: True}

    def replace(self, **changes: Any) -> Case:
        return ExactScaleCase.of(super().replace(**changes))

    @classmethod
    def of(cls, case: Case) -> ExactScaleCase:
        return cls(**{f.name: getattr(case, f.name) for f in dataclasses.fields(Case)})


@dataclasses.dataclass(frozen=True)
class ExactScale:
    """The mapping of a program's own rerun with the factor exact (used where ``comparison`` uses a ``SideMapping``).

    ``side``: the TensorFlow plugin whose float64 run carried the factor.
    """

    side: str
    factor: float

    @property
    def key(self) -> str:
        return EXACT_SCALE

    @property
    def ident(self) -> tuple[str, str]:
        return self.side, self.key

    @property
    def text(self) -> str:
        return (f"{self.side} rerun with Keras' distribution loss scale exact (1/N in float64, not its"
                f" float32(1/N) N = 1 + {self.factor - 1:.3g})")

    def apply(self, case: Case) -> Case:
        return ExactScaleCase.of(case)


def without_loss_scale(pred: Prediction) -> Prediction:
    """``pred`` without Keras' distribution loss scale (``theory.LOSS_SCALE``): what is left to explain a gap
    between the pair's reruns with the loss scale exact, which no longer carry it."""
    return Prediction.of([d for d in pred.differences if d.mapping != LOSS_SCALE], list(pred.absent))
