"""The matrix command's engine: rows, report files, exit status."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.reporting.matrix import EXPECTED_ROWS, SCENARIOS, matrix_cases, run_matrix
from parity_tests.running.harness import run_impl

pytestmark = pytest.mark.usefixtures("pool")


def test_matrix_covers_scenarios_devices_combines_dtypes():
    cases = matrix_cases()
    names = {c.name for c in cases}
    for s in SCENARIOS:
        for n in (1, 2, 4, 8):
            for combine in ("grad_mean", "loss_mean"):
                for dtype in ("float32", "float64"):
                    assert f"{s.name}:n{n}:{combine}:{dtype}" in names
    for name, _, _ in EXPECTED_ROWS:
        assert any(c.name.startswith(name + ":") for c in cases)


def _small():
    return [c for c in matrix_cases(devices=(2,), dtypes=("float64",), combines=("grad_mean",))
            if c.name.split(":")[0] in ("mlp-sgd", "mlp-sum-reduction")]


def test_matrix_report_and_exit_0(tmp_path, capsys):
    assert run_matrix(tmp_path, cases=_small(), junit=tmp_path / "junit.xml") == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["schema"] == "tfpar-report/1"
    assert doc["all_as_expected"] is True and "torch" in doc["versions"]
    junit = ET.parse(tmp_path / "junit.xml").getroot()  # one suite per row, one test case per pair
    assert (junit.get("tests"), junit.get("failures"), junit.get("errors")) == ("10", "0", "0")
    assert sorted(s.get("name") for s in junit.findall("testsuite")) == sorted(c.name for c in _small())
    statuses = {(r["case"], r["pair"]): r["status"] for r in doc["rows"]}
    assert statuses[("mlp-sum-reduction:n2:grad_mean:float64", "tf.towers vs tf.single")] == "expected_difference"
    assert statuses[("mlp-sum-reduction:n2:grad_mean:float64", "tf.towers vs torch.ddp")] == "parity"
    md = (tmp_path / "report.md").read_text()
    assert "| mlp-sgd | float64 | 2 | grad_mean |" in md and "gaps-mlp-sgd.png" in md
    assert (tmp_path / "gaps-mlp-sgd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "10 / 10 verdicts as expected" in capsys.readouterr().out  # 2 cases x 5 pairs


def test_matrix_exit_1_when_a_verdict_is_not_the_expected_one(tmp_path, capsys):
    def buggy(case, impl):  # a DDP that forgets to average: every rank's gradient summed
        if impl == "torch.ddp":
            n = case.devices
            case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * n})
        return run_impl(case, impl)

    assert run_matrix(tmp_path, cases=_small(), runner=buggy, junit=tmp_path / "junit.xml") == 1
    out = capsys.readouterr().out
    failed = ET.parse(tmp_path / "junit.xml").getroot().findall("testsuite/testcase[failure]")
    named = [(tc.get("classname"), tc.get("name")) for tc in failed]
    assert ("mlp-sgd:n2:grad_mean:float64", "tf.towers vs torch.ddp") in named, named
    assert len(named) == out.count("NOT AS EXPECTED") - out.count("inconclusive") - out.count("error"), out
    assert "NOT AS EXPECTED: mlp-sgd:n2:grad_mean:float64: tf.towers vs torch.ddp: divergence" in out
    assert "**NO**" in (tmp_path / "report.md").read_text()


def test_resume_reuses_finished_rows_and_reruns_missing_ones(tmp_path, capsys):
    cases = _small()
    assert run_matrix(tmp_path, cases=cases) == 0
    rows = sorted((tmp_path / "rows").glob("*.json"))
    assert len(rows) == len(cases)
    rows[0].unlink()  # as if the run had been interrupted before this row
    capsys.readouterr()
    calls = []

    def counting(case, impl):
        calls.append(case.name)
        return run_impl(case, impl)

    assert run_matrix(tmp_path, cases=cases, resume=True, runner=counting) == 0
    assert len(set(calls)) == 1  # only the missing row ran again
    assert f"({len(cases) - 1} rows reused from an earlier run)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert len({r["case"] for r in doc["rows"]}) == len(cases)


def test_architecture_rows_cover_devices_dtypes_combines_and_semantics():
    """Each architecture at 1, 2, 4 and 8 devices, and over its four rows both dtypes, both combines and
    native and mapped semantics; every pair of values of two of those fields meets for some architecture."""
    from parity_tests.reporting.matrix import ARCHITECTURE_ROWS, ARCHITECTURES

    cases = {c.name: c for c in matrix_cases()}
    for s in ARCHITECTURES:
        rows = [r for r in ARCHITECTURE_ROWS if r[0] == s.name]
        assert sorted(r[1] for r in rows) == [1, 2, 4, 8]
        for field in (2, 3, 4):
            assert len({r[field] for r in rows}) == 2, (s.name, field)
        for name, n, dtype, combine, semantics in rows:
            case = cases[f"{name}-{semantics}:n{n}:{combine}:{dtype}"]
            assert (case.devices, case.spec["dtype"], case.spec["parallel"]["combine"]) == (n, dtype, combine)
    for a, b in ((2, 3), (2, 4), (3, 4)):
        assert len({(r[a], r[b]) for r in ARCHITECTURE_ROWS}) == 4
    assert len({(r[1], r[2], r[3], r[4]) for r in ARCHITECTURE_ROWS}) == len(ARCHITECTURE_ROWS)


def test_mapped_sets_one_convention_everywhere_and_native_keeps_each_frameworks():
    from parity_tests.contract.model import nested_layers
    from parity_tests.reporting.matrix import ARCHITECTURES, mapped

    for s in ARCHITECTURES:
        for raw, want in ((s.case, "native"), (mapped(s.case), "torch")):
            case = case_from_dict(raw)
            assert case.spec["optimizer"]["semantics"] == want
            layers = [layer for _, layer in nested_layers(case.spec["model"]["layers"])]
            for layer in layers:
                if layer["type"] in ("batch_norm", "attention"):
                    assert layer["semantics"] == want, (s.name, layer)
                if layer["type"] == "embedding":
                    assert layer["gradient"] == ("dense" if want == "torch" else "native")
            assert any(layer["type"] in ("batch_norm", "attention") for layer in layers)
