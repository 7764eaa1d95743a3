"""judging.rules.bfloat16_signature: each side of a mixed pair must show a bfloat16 rounding at step 1, where the
case can show one at all."""

from __future__ import annotations

import numpy as np

from parity_tests.judging.perturbation import round_bfloat16
from parity_tests.judging.rules.bfloat16_signature import BFloat16Signature, SignatureSide
from parity_tests.judging.rules.context import Can, Planned
from parity_tests.judging.run_kinds import STEP1
from parity_tests.judging.verdict import RULE_BF16_SIGNATURE, Verdict

# a step-1 gradient in float64, its float32 run, and a mixed run that rounds it to bfloat16 (2^-9 relative: far above
# float32's 2^-24, so 16 x the float32 run's own gap to float64 is below it)
G64 = np.array([[0.8331925, -0.5060863, 0.2228609]])
F64 = {"loss": np.array([0.6925160]), "grad/0.kernel": G64}
F32 = {"loss": np.float32([0.6925160]), "grad/0.kernel": G64.astype(np.float32)}
MIXED = {"loss": np.float32([0.6925160]), "grad/0.kernel": round_bfloat16(G64.astype(np.float32)).astype(np.float32)}
PARITY = Verdict("parity", "bfloat16 computation", 0.0, 1e-6, None, None, np.zeros(1), None, "at parity")


def _side(name: str, bf16: bool) -> SignatureSide:
    return SignatureSide(name, MIXED if bf16 else dict(F32), F32, F64)


def test_a_side_that_shows_no_bfloat16_rounding_beside_one_that_does_is_a_divergence():
    v = BFloat16Signature().judge(PARITY, [_side("a", True), _side("b", False)])
    assert (v.status, v.rule, v.step) == ("divergence", RULE_BF16_SIGNATURE, 1)
    assert v.detail.startswith("b does not compute in bfloat16")


def test_both_sides_computing_in_bfloat16_keep_the_verdict():
    assert BFloat16Signature().judge(PARITY, [_side("a", True), _side("b", True)]) is PARITY


def test_a_case_that_shows_bfloat16_on_neither_side_cannot_tell_and_says_so():
    """The hunt's pair 265 (a 2-class model clipped to 1e-6: the clip turns [g, -g] into the same numbers whatever the
    rounding, the loss of logits near 0 moves by 4.6 x float32's own rounding): neither side can show bfloat16, so
    whether each computes in it is not read: inconclusive, not a divergence naming the first side."""
    v = BFloat16Signature().judge(PARITY, [_side("a", False), _side("b", False)])
    assert (v.status, v.rule) == ("inconclusive", RULE_BF16_SIGNATURE)
    assert "shows no bfloat16 rounding at step 1 on either side" in v.detail
    assert "a 0.00e+00 at" in v.detail and "b 0.00e+00 at" in v.detail  # each side's own reading, named


def test_its_runs_are_each_sides_first_step_in_float32_in_a_mixed_case_only():
    full, recorded = Can(), Can(float64=False, rerunnable=False)
    assert BFloat16Signature().needs(Planned("mixed_bfloat16", "perturbation", full, recorded)) == ((STEP1,), ())
    assert BFloat16Signature().needs(Planned("float32", "float64", full, full)) is None


def test_a_pair_that_parts_keeps_its_verdict_where_neither_side_shows_bfloat16():
    """The second seed's lr_times_n miss (2026-11-29): a divergence of 0.92 between the sides was turned into
    ``inconclusive`` because neither side's step 1 showed a bfloat16 rounding; only a parity needs the signature."""
    parted = Verdict("divergence", "bfloat16 against float64", 0.92, 1e-3, None, None, np.zeros(1), None, "apart")
    assert BFloat16Signature().judge(parted, [_side("a", False), _side("b", False)]) is parted


# the seed-1 hunt's pair 857 (2026-11-29), as measured: one weight, two one-row devices whose gradients of opposite
# sign are each clipped to 1e-6 before the mean: torch.ddp's combined gradient is 0 in exact arithmetic, recorded 0 in
# float64 and bfloat16 and -5.7e-14 (rounding residue) in float32; tf.single clips the full batch's gradient to -1e-6
LOSS = {"f64": np.array([0.6866548193931992]), "f32": np.float32([0.686654806137085]),
        "mixed": np.float32([0.6866157650947571])}  # the mixed loss 5.7e-5 from float32's: bfloat16's rounding


def _cancelled(bf16: bool) -> SignatureSide:
    return SignatureSide("torch.ddp", {"loss": LOSS["mixed" if bf16 else "f32"], "grad/0.kernel": np.zeros((1, 1, 1))},
                         {"loss": LOSS["f32"], "grad/0.kernel": np.full((1, 1, 1), -5.684341886080802e-14)},
                         {"loss": LOSS["f64"], "grad/0.kernel": np.zeros((1, 1, 1))})


def _clipped() -> SignatureSide:
    g32 = np.full((1, 1, 1), -9.999999974752427e-07)
    return SignatureSide("tf.single", {"loss": LOSS["mixed"], "grad/0.kernel": g32}, {"loss": LOSS["f32"], "grad/0.kernel": g32},
                         {"loss": LOSS["f64"], "grad/0.kernel": np.full((1, 1, 1), -1e-6)})


def test_a_gradient_zero_in_float64_reads_no_signature_and_the_loss_still_does():
    """Pair 857: the residue of an exactly cancelled gradient (0 against -5.7e-14, measured against itself: a gap of
    1.0 in the signature and in its bound, 16) hid the loss's bfloat16 rounding and called the correct torch.ddp one
    that does not compute in bfloat16. Left out, the loss reads it (5.7e-5 > 16 x 1.9e-8 + 2.4e-7): the verdict
    stands. A side whose mixed loss is its float32 loss still shows none: the divergence still fires."""
    expected = Verdict("expected_difference", "float64 bound", 2.9e-7, 1e-10, None, None, np.zeros(1), None, "as predicted")
    assert BFloat16Signature().judge(expected, [_clipped(), _cancelled(True)]) is expected
    v = BFloat16Signature().judge(expected, [_clipped(), _cancelled(False)])
    assert (v.status, v.rule, v.key) == ("divergence", RULE_BF16_SIGNATURE, "loss")
    assert v.detail.startswith("torch.ddp does not compute in bfloat16")
