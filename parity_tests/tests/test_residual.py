"""session.residual.resolve_pair: one pair resolved against theory from its runs, as the free compare and each
--lockstep step do (both call it; their own tests exercise it on real runs: test_mapping.py, test_loss_scale.py,
test_lockstep_plugins.py). Here its logic on canned verdicts, one leg a run."""

from __future__ import annotations

import numpy as np

from parity_tests.judging.theory import Prediction, _diff
from parity_tests.judging.verdict import RULE_FLOAT64, Verdict
from parity_tests.session.mapping import NOT_EQUIVALENT, SideMapping
from parity_tests.session.residual import resolve_pair


def _v(status: str, gap: float) -> Verdict:
    return Verdict(status, RULE_FLOAT64, gap, 1e-10, None, None, np.array([0.0, gap]), None,
                   f"{status}, gap {gap}", first_step=1 if status == "divergence" else None, step=1, key="param/0.kernel")


class Canned:
    """Legs whose verdicts are given by pair of legs (``stages``: where each pair parts)."""

    def __init__(self, verdicts: dict, stages: dict | None = None) -> None:
        self.verdicts, self.stages, self.asked = verdicts, stages or {}, []

    def as_ran(self) -> Verdict:
        return self.verdict("a", "b")

    def verdict(self, a, b) -> Verdict:
        self.asked.append((a, b))
        return self.verdicts[(a, b)]

    def stage(self, a, b, verdict, refine=False):
        return self.stages.get((a, b))

    def leaky(self, legs) -> bool:
        return False


PRED = Prediction.of([_diff("Adam epsilon placement: Keras adds eps to sqrt(v)", certain=True, mapping="optimizer")], [])
BUILT_IN = SideMapping("torch.ddp", "tf.towers", {"optimizer.semantics": "tf"}, "torch.ddp")
STAND_IN = SideMapping("p.py:train", "tf.towers", {"optimizer.semantics": "tf"}, "torch.ddp")


def test_a_built_in_mapped_at_parity_explains_the_gap():
    legs = Canned({("a", "b"): _v("divergence", 1e-3), ("a", "sm"): _v("parity", 1e-16)})
    r = resolve_pair(legs, "a", "b", PRED, mapping=BUILT_IN, mapped="sm")
    assert r.final.status == "expected_difference" and r.decided == ("a", "sm") and r.not_judged is None


def test_a_built_in_mapped_still_apart_is_a_divergence():
    legs = Canned({("a", "b"): _v("divergence", 1e-3), ("a", "sm"): _v("divergence", 1e-4)})
    r = resolve_pair(legs, "a", "b", PRED, mapping=BUILT_IN, mapped="sm")
    assert r.final.status == "divergence" and r.resolution.from_residual


def test_a_stand_in_that_parts_from_its_plugin_before_the_update_judges_no_residual():
    """The stand-in computes another program (a loss term the case cannot express): its mapped leg, at parity here,
    says nothing; the pair is resolved by the stage where it parts, and says why no residual was judged."""
    legs = Canned({("a", "b"): _v("divergence", 1e-3), ("a", "sm"): _v("parity", 0.0), ("s", "b"): _v("divergence", 1e-3)},
                  {("s", "b"): "device_grads", ("a", "b"): "update"})
    r = resolve_pair(legs, "a", "b", PRED, mapping=STAND_IN, mapped="sm", stand="s")
    assert r.residual is None and r.not_judged.startswith(NOT_EQUIVALENT)
    assert r.final.status == "expected_difference"  # parts at the update, where theory's difference acts
    assert any(NOT_EQUIVALENT in u for u in r.final.unjudged)


def test_the_exact_loss_scale_reruns_are_the_residual_where_the_stand_in_is_no_equivalent_run():
    legs = Canned({("a", "b"): _v("divergence", 3e-8), ("a", "sm"): _v("parity", 0.0), ("s", "be"): _v("divergence", 1e-3),
                   ("a", "be"): _v("parity", 1e-17)}, {("s", "be"): "loss"})
    r = resolve_pair(legs, "a", "b", PRED, mapping=STAND_IN, mapped="sm", stand="s", exact_b="be", exact_text="exact")
    assert r.residual is not None and r.residual.status == "parity" and r.decided == ("a", "be")
    assert r.not_judged is None and r.text == "exact"


def test_exact_reruns_that_move_nothing_in_float32_are_the_residual_where_their_float64_runs_move_and_agree():
    """Seed 10's pair 671 (keras_fit_l2 against ddp_l2, float32, 3 replicas, lr 1e-7, 1 step): the float64 loss 2^-25
    apart (Keras' float32(1/3)), nothing else. The exact rerun against the port is ``inconclusive`` (no float32
    parameter moves beyond its noise) with its float64 runs moving and agreeing (``Verdict.float64_runs``): that is
    the residual, as for a stand-in's showing (``mapping.float64_shown``). An exact rerun whose float64 runs part,
    or whose float32 leg is inconclusive with no float64 showing, is none."""
    import dataclasses

    def legs(exact: Verdict) -> Canned:
        return Canned({("a", "b"): _v("divergence", 3e-8), ("a", "sm"): _v("parity", 0.0),
                       ("s", "be"): _v("divergence", 1e-3), ("a", "be"): exact}, {("s", "be"): "loss", ("a", "b"): "loss"})

    def run(exact: Verdict):
        return resolve_pair(legs(exact), "a", "b", PRED, mapping=STAND_IN, mapped="sm", stand="s", exact_b="be",
                            exact_text="exact")

    nothing = dataclasses.replace(_v("inconclusive", 0.0), rule="nothing compared")
    shown = run(dataclasses.replace(nothing, float64_runs=_v("parity", 1e-17)))
    assert shown.residual is not None and shown.not_judged is None and shown.decided == ("a", "be")
    assert shown.final.status == "expected_difference", shown.final.detail
    for unshown in (nothing, dataclasses.replace(nothing, float64_runs=_v("divergence", 1e-3))):
        r = run(unshown)
        assert r.residual is None and r.not_judged is not None and r.not_judged.startswith(NOT_EQUIVALENT)


def test_no_mapping_judges_no_residual_and_asks_for_the_stage():
    legs = Canned({("a", "b"): _v("divergence", 1e-3)}, {("a", "b"): "update"})
    r = resolve_pair(legs, "a", "b", PRED)
    assert r.residual is None and legs.asked == [("a", "b")]
    assert r.final.status == "expected_difference"  # parted no earlier than theory's stage (update)
    early = resolve_pair(Canned({("a", "b"): _v("divergence", 1e-3)}, {("a", "b"): "forward"}), "a", "b", PRED)
    assert early.final.status == "divergence"  # parted before the update: not the predicted difference


def test_a_known_difference_acting_before_the_predicted_stage_is_where_the_runs_may_part_first():
    """The 10,000-pair run's s8-0233 (keras_model against torch.ddp, native Adam, a warmup_cosine, a clip of 1e-6):
    no residual judged, the runs part first at the clip, where the known difference "torch clip_grad_norm_ adds 1e-6
    to the norm" acts, before the expected ones (epsilon placement, Keras' CosineDecay a step late) at the update.
    The where-line already said so ("where the known difference ... acts"); the verdict said "not the predicted
    difference". It is the expected difference now, naming the known one; a part at the forward pass, where no known
    difference acts, stays a divergence."""
    clip = _diff("torch clip_grad_norm_ adds 1e-6 to the norm: scale c/(norm+1e-6) vs TensorFlow's c/norm",
                 expected=False, mapping="optimizer")
    pred = Prediction.of([*PRED.differences, clip], [])
    at_clip = resolve_pair(Canned({("a", "b"): _v("divergence", 1.0)}, {("a", "b"): "clip"}), "a", "b", pred)
    assert at_clip.final.status == "expected_difference", at_clip.final.detail
    assert "first at clip, where the known difference 'torch clip_grad_norm_ adds 1e-6 to the norm' acts" in \
        at_clip.final.detail
    without = resolve_pair(Canned({("a", "b"): _v("divergence", 1.0)}, {("a", "b"): "clip"}), "a", "b", PRED)
    assert without.final.status == "divergence"  # no known difference acts there: not the predicted difference
    forward = resolve_pair(Canned({("a", "b"): _v("divergence", 1.0)}, {("a", "b"): "forward"}), "a", "b", pred)
    assert forward.final.status == "divergence"
