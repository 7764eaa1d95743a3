"""The judge: verdicts, expected and known differences, and injected bugs it must catch."""

from __future__ import annotations

import pytest

from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, POLY, make

pytestmark = pytest.mark.usefixtures("pool")


def test_parity_float64_exact_semantics():
    r = compare_case(make(MLP, optimizer__semantics="torch"), ["tf.towers", "torch.ddp", "tf.single", "torch.single"])
    assert r.parity and r.as_expected, r.summary()
    assert all(p.verdict.rule == "float64 bound" for p in r.pairs)


def test_float32_case_is_judged_against_the_noise_floor():
    r = compare_case(make(POLY, dtype="float32", optimizer__semantics="tf"), ["tf.towers", "torch.ddp"])
    v = r.pairs[0].verdict
    assert r.parity, r.summary()
    assert v.rule == "float32 noise floor" and v.floor_a is not None and v.floor_b is not None
    assert v.floor_a > 0 and v.floor_b > 0  # float32 really rounds: a floor of 0 would mean float64 ran twice


def test_a_wrong_learning_rate_on_one_side_is_caught_with_step_and_parameter():
    """Mutation test: the torch side gets lr * (1 + 1e-6): a bug far below float32 noise per step."""
    def buggy(case, impl):
        if impl == "torch.ddp":
            case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * (1 + 1e-6)})
        return run_impl(case, impl)

    r = compare_case(make(MLP, optimizer__semantics="torch"), ["tf.towers", "torch.ddp"], runner=buggy)
    v = r.pairs[0].verdict
    assert not r.parity and v.status == "divergence"
    assert v.first_step == 1 and v.key.startswith("param/")
    assert "step 1, param" in v.detail


def test_sum_reduction_is_an_expected_difference_and_parity_there_is_flagged():
    case = make(MLP, model__reduction="sum", optimizer__semantics="torch")
    r = compare_case(case, ["torch.ddp", "torch.single"])
    p = r.pairs[0]
    assert p.verdict.status == "expected_difference" and p.as_expected and not r.parity
    assert "sum reduction" in p.prediction.expected[0]

    # a "DDP" that secretly computes the full-batch sum would be unexpected parity
    def too_good(c, impl):
        return run_impl(c, "torch.single")

    r2 = compare_case(case, ["torch.ddp", "torch.single"], runner=too_good)
    assert r2.pairs[0].verdict.status == "unexpected_parity" and not r2.as_expected


def test_native_adam_across_frameworks_is_the_epsilon_placement():
    case = make(POLY, optimizer={"name": "adam", "lr": 0.05, "epsilon": 1e-3, "semantics": "native"})
    r = compare_case(case, ["tf.towers", "torch.ddp", "tf.single"])
    ddp, single = r.pairs
    assert ddp.verdict.status == "expected_difference"
    assert any("epsilon" in e for e in ddp.prediction.expected)
    assert single.verdict.status == "parity"  # same framework, same class


def test_keras_float32_hyperparameters_are_mapped_and_reported():
    case = make(MLP, optimizer={"name": "momentum", "lr": 0.01, "momentum": 0.9, "semantics": "native"})
    r = compare_case(case, ["tf.towers", "torch.ddp"])
    p = r.pairs[0]
    assert p.verdict.status == "parity", r.summary()
    assert p.mapping and "float32" in p.mapping
    assert p.unmapped_gap is not None and p.unmapped_gap > 1e-10  # the effect is real and reported
    assert p.prediction.known


def test_the_perturbed_copy_of_the_weights_is_made_only_for_a_perturbation_rule(monkeypatch):
    """A float32 case's perturbed variant is a copy of the model (1 GB for GPT-2 small in float64): made where
    a pair is judged by the perturbation floor, never where the float64 rule decides every pair."""
    from parity_tests.session import variants

    made: list[str] = []
    real = variants.perturbed_case
    monkeypatch.setattr(variants, "perturbed_case", lambda c, *a: (made.append(c.name), real(c, *a))[1])
    case = make(POLY, dtype="float32", optimizer__semantics="tf")
    r = compare_case(case, ["tf.towers", "torch.ddp"])
    assert r.pairs[0].verdict.rule == "float32 noise floor" and made == []
    r = compare_case(case, ["tf.towers", "torch.ddp"], floor="perturbation")
    assert r.pairs[0].verdict.rule != "float32 noise floor" and made, r.summary()
    assert "moved by one float32 ulp" in r.pairs[0].verdict.detail


def test_a_variant_asked_for_from_two_threads_at_once_is_made_once():
    """The TensorFlow and torch runs go beside each other in two threads, and both may ask for the perturbed
    variant first (tests/test_placement.py once raised KeyError in one of them)."""
    import threading
    import time

    from parity_tests.session.comparison import _Variants

    made: list[object] = []

    def slow() -> object:
        time.sleep(0.2)  # both threads are inside before the first is done
        made.append(object())
        return made[-1]

    variants = _Variants({}, {"float32+perturbed": slow})
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(variants["float32+perturbed"])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got == [made[0], made[0]]
    assert "float32+perturbed" in variants and "float64" not in variants


def test_a_result_reads_as_a_small_table_not_as_arrays():
    """``repr`` of what ``compare_case`` returns (a notebook shows it): the case, one row per pair and the
    verdict line, never the per-step gaps or the trajectories (a dataclass repr printed both)."""
    import re

    import numpy as np

    from parity_tests.judging.theory import Prediction
    from parity_tests.judging.verdict import Verdict
    from parity_tests.session.comparison import CaseResult, PairResult

    gaps = np.linspace(0.0, 1e-16, 1001)  # long enough that numpy would elide it with "..."
    same = Verdict("parity", "float64 bound", 3e-16, 1e-10, None, None, gaps, None, "within", step=3, key="param/0.kernel")
    apart = Verdict("divergence", "float64 bound", 0.5, 1e-10, None, None, gaps, None, "step 1, loss: Mismatched elements",
                    step=1, key="loss", first_step=1)
    pairs = [PairResult("tf.towers", "torch.ddp", same, Prediction((), ())),
             PairResult("tf.towers", "tf.single", apart, Prediction((), ()),
                        localisation={"stage": "loss", "first_bad_step": 1, "explanation": "the losses differ"})]
    result = CaseResult(make(MLP, parallel__devices=2), ["tf.towers", "torch.ddp", "tf.single"], pairs,
                        {"tf.towers@float64": {"param/0.kernel": np.zeros((1001, 50))}}, 1.5)
    lines = repr(result).splitlines()
    assert "array" not in repr(result) and "..." not in repr(result)
    assert lines[0] == "CaseResult: case mlp: float64, 2 device(s), grad_mean, sgd (native), 4 steps"
    assert re.fullmatch(r"tf\.towers vs torch\.ddp +parity +float64 bound +3e-16 +1e-10", lines[2]), lines
    assert re.fullmatch(r"tf\.towers vs tf\.single +divergence +float64 bound +0\.5 +1e-10", lines[3]), lines
    assert lines[4:] == ["verdict: DIVERGENCE (1.5 s)"]
    assert repr(pairs[0]) == "PairResult(tf.towers vs torch.ddp: parity, float64 bound, gap 3e-16, bound 1e-10)"
    assert repr(same) == "Verdict(parity, float64 bound: gap 3e-16, bound 1e-10 at step 3, param/0.kernel)"
    assert repr(apart).endswith("at step 1, loss; first over the bound at step 1)")
    assert pairs[1].where() == "tf.single: where: loss at step 1 (the losses differ)" and pairs[0].where() == ""
