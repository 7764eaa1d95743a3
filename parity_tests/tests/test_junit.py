"""``parity_tests.reporting.junit``: JUnit XML a CI tool reads, one test case per pair, and exit statuses."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest

from parity_tests.judging.theory import Prediction
from parity_tests.judging.verdict import EXIT_STATUS, STATUSES, Verdict, exit_status
from parity_tests.reporting.junit import (
    cases_of,
    failed_run_cases,
    junit_xml,
    lockstep_cases_of,
    write_junit,
)
from parity_tests.session.comparison import CaseResult, PairResult
from parity_tests.session.lockstep import LockstepPair, LockstepResult
from parity_tests.tests.helpers import MLP, make

LOC = {"stage": "device_grads", "first_bad_step": 3, "explanation": "the gradient of every device differs in 0.kernel by 4x"}


def _verdict(status: str, detail: str) -> Verdict:
    return Verdict(status, "float64 bound", 0.5 if status == "divergence" else 0.0, 1e-10, None, None,
                   np.zeros(5), None, detail)


def _result() -> CaseResult:
    """One pair of each status a compared pair can have, plus ``unsupported`` (a matrix row's)."""
    pairs = [
        PairResult("tf.towers", "torch.ddp", _verdict("parity", "within"), Prediction((), ())),
        PairResult("tf.towers", "tf.single", _verdict("expected_difference", "sum reduction"), Prediction(("sum",), ())),
        PairResult("tf.towers", "bug.py:train", _verdict("divergence", "gap 0.5 > bound 1e-10\nstep 3, param 0.kernel: "
                                                                       "Mismatched elements: 1 / 10 (10.0%)"),
                   Prediction((), ()), localisation=LOC),
        PairResult("tf.towers", "torch.single", _verdict("unexpected_parity", "the predicted sum reduction did not show"),
                   Prediction(("sum",), ())),
        PairResult("tf.towers", "frozen.py:train", _verdict("inconclusive", "nothing compared: no parameter moves"),
                   Prediction((), ())),
        PairResult("tf.towers", "nan.py:train", _verdict("error", "both runs become non-finite\x1b[0m at step 2"),
                   Prediction((), ())),
        PairResult("tf.towers", "tf.v1", _verdict("unsupported", "tf.v1 does not run this case: parallel.combine"),
                   Prediction((), ())),
    ]
    return CaseResult(make(MLP, parallel__devices=2), ["tf.towers"] + [p.impl for p in pairs], pairs, {}, 4.25)


def test_every_pair_is_a_test_case_and_each_status_its_element(tmp_path):
    path = write_junit(tmp_path / "ci" / "junit.xml", cases_of(_result()), name="tfpar compare")
    assert not list((tmp_path / "ci").glob(".*.tmp"))  # written atomically
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and root.get("name") == "tfpar compare"
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "7", "failures": "2", "errors": "2", "skipped": "1"}
    (suite,) = root.findall("testsuite")
    assert suite.get("name") == "mlp" and suite.get("tests") == "7" and float(suite.get("time")) == 4.25
    cases = {tc.get("name"): tc for tc in suite.findall("testcase")}
    assert all(tc.get("classname") == "mlp" for tc in cases.values())
    assert list(cases["tf.towers vs torch.ddp"]) == [] and list(cases["tf.towers vs tf.single"]) == []
    failure = cases["tf.towers vs bug.py:train"].find("failure")
    where = "bug.py:train: where: device_grads at step 3 (the gradient of every device differs in 0.kernel by 4x)"
    assert failure.get("type") == "divergence" and failure.get("message") == where
    assert failure.text.splitlines() == [where, "gap 0.5 > bound 1e-10", "step 3, param 0.kernel: Mismatched elements: "
                                         "1 / 10 (10.0%)"]
    unexpected = cases["tf.towers vs torch.single"].find("failure")
    assert unexpected.get("type") == "unexpected_parity"
    assert unexpected.get("message") == "torch.single: the predicted sum reduction did not show"
    inconclusive = cases["tf.towers vs frozen.py:train"].find("error")
    assert inconclusive.get("type") == "inconclusive" and "no parameter moves" in inconclusive.get("message")
    error = cases["tf.towers vs nan.py:train"].find("error")
    assert error.get("type") == "error" and "\x1b" not in error.text and "non-finite?[0m at step 2" in error.text
    skipped = cases["tf.towers vs tf.v1"].find("skipped")
    assert skipped.get("message") == "tf.v1: tf.v1 does not run this case: parallel.combine" and skipped.text is None


def test_lockstep_pairs_and_a_failed_run_are_test_cases_too():
    steps = np.arange(1.0, 4.0)
    free = _result()
    bad = LockstepPair("tf.towers", "torch.ddp", "divergence", "float64 bound", steps, 1e-10 + 0 * steps,
                       ["parity", "divergence", "divergence"], steps, steps, first_bad_step=2, detail="gap 2 > 1e-10")
    good = LockstepPair("tf.towers", "tf.single", "parity", "float64 bound", 0 * steps, 1e-10 + 0 * steps,
                        ["parity"] * 3, steps, steps)
    root = ET.fromstring(junit_xml(lockstep_cases_of(LockstepResult(free, [bad, good], 1.0, 2.0)), name="lockstep"))
    (suite,) = root.findall("testsuite")
    assert suite.get("name") == "mlp (lockstep)" and (root.get("tests"), root.get("failures")) == ("2", "1")
    assert suite.find("testcase/failure").get("message") == "torch.ddp: step 2: gap 2 > 1e-10"
    failed = ET.fromstring(junit_xml(failed_run_cases("mlp", ["tf.towers", "torch.ddp", "x.py:f"],
                                                      "run failed: x.py:f raised at step 3: ValueError: no"), name="c"))
    assert (failed.get("tests"), failed.get("errors")) == ("2", "2")
    assert [e.get("message") for e in failed.iter("error")] == ["run failed: x.py:f raised at step 3: ValueError: no"] * 2


@pytest.mark.parametrize(("statuses", "code"), [
    (["parity", "expected_difference"], 0),
    (["parity", "divergence"], 1),
    (["unexpected_parity"], 1),
    (["parity", "inconclusive"], 3),
    (["error", "expected_difference"], 3),
    (["inconclusive", "divergence"], 1),  # something wrong was shown: that is the worst
    (["error", "unexpected_parity"], 1),
    ([], 0),
])
def test_exit_status_is_the_worst_pairs_with_1_worse_than_3(statuses, code):
    assert exit_status(statuses) == code


def test_every_status_has_an_exit_status_and_a_result_says_its_own():
    assert set(EXIT_STATUS) == set(STATUSES)
    result = _result()
    assert result.exit_status == 1
    result.pairs[:] = [p for p in result.pairs if p.verdict.status in ("parity", "inconclusive")]
    assert result.exit_status == 3
