"""Noise or bug (``parity_tests.session.noise``): two recorded float32 runs judged against their stand-ins' floors.

Must say "within rounding" for two correct runs of one case made by different implementations (DDP on 4
ranks, one process on the whole batch), and "not rounding", naming the side that is off, for a recorded
run of torchtitan's double-averaging bug (examples/wild/), whose logged loss agrees to 4e-9.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity_tests.cli import main
from parity_tests.contract.case import load_case
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.session.noise import (
    check_recorded_mix,
    noise_or_bug,
    noise_or_bug_all,
    recorded_runs,
    stand_in,
)

ROOT = Path(__file__).resolve().parents[2]
CASE = ROOT / "examples" / "wild" / "noise-or-bug" / "case.json"
BUGGY = f"{ROOT / 'examples' / 'wild' / 'torchtitan-ddp-double-average' / 'ddp.py'}:buggy"
FIXED = BUGGY.replace(":buggy", ":fixed")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, request):
    request.getfixturevalue("pool")
    out = tmp_path_factory.mktemp("noise")
    case = out / "case.json"
    case.write_text(CASE.read_text().replace('"steps": 10', '"steps": 3'))
    for impl, name in (("torch.ddp", "ddp"), ("torch.single", "single"), (BUGGY, "buggy"), (FIXED, "fixed")):
        assert main(["run", str(case), "--impl", impl, "--out", str(out / f"{name}.npz")]) == 0
    return out


def test_two_correct_runs_are_within_rounding(recorded):
    case = load_case(recorded / "case.json")
    names = (f"recorded:{recorded / 'ddp.npz'}", f"recorded:{recorded / 'single.npz'}")
    assert recorded_runs(case, list(names))
    assert not recorded_runs(case, [names[0], "torch.ddp"]) and not recorded_runs(case, [names[0]])
    assert [stand_in(n) for n in names] == ["torch.ddp", "torch.single"]
    result = noise_or_bug(case, names, run_impl)
    assert result.status == "parity", result.summary()
    assert 0 < result.bound < 1e-4                    # a float32 floor: 2 x (1e-7 .. 1e-5) + 4 x 2^-24
    assert all(s.off is None for s in result.sides), result.summary()


def test_a_recorded_bug_is_not_rounding_and_its_side_is_named(recorded):
    case = load_case(recorded / "case.json")
    names = (f"recorded:{recorded / 'ddp.npz'}", f"recorded:{recorded / 'buggy.npz'}")
    result = noise_or_bug(case, names, run_impl)
    assert result.status == "divergence" and result.first_step == 1, result.summary()
    assert result.gap == pytest.approx(0.75, rel=1e-3)  # the combined gradient is 1/4 of the reference's
    assert result.sides[0].off is None and result.sides[1].off == 1, result.summary()
    assert "NOT rounding" in result.summary()


def test_the_command_line_answers_in_one_command(recorded, capsys):
    code = main(["compare", str(recorded / "case.json"), "--impls",
                 f"recorded:{recorded / 'ddp.npz'},recorded:{recorded / 'buggy.npz'}"])
    assert code == 1
    assert "noise or bug:" in capsys.readouterr().out


def test_three_recorded_runs_in_one_compare_are_each_judged_against_the_first(recorded, capsys):
    # three recorded float32 runs went to the ordinary comparison, which has no float64 or perturbed run of a
    # recorded side to judge them by: a traceback from judge_perturbation
    names = [f"recorded:{recorded / n}.npz" for n in ("ddp", "single", "buggy")]
    code = main(["compare", str(recorded / "case.json"), "--impls", ",".join(names)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"noise or bug: 3 recorded runs, each against {names[0]} (the first): 1 within rounding, 1 not" in out
    assert f"noise or bug: {names[0]} vs {names[1]}: within what rounding explains" in out, out
    assert f"noise or bug: {names[0]} vs {names[2]}: NOT rounding" in out, out
    # the must-not-fire side: three correct runs (torchtitan's fixed loop the third), every pair within rounding
    code = main(["compare", str(recorded / "case.json"), "--impls", ",".join([*names[:2], f"recorded:{recorded}/fixed.npz"])])
    out = capsys.readouterr().out
    assert code == 0 and "3 recorded runs" in out and "2 within rounding, 0 not" in out, out


def test_every_recorded_run_and_stand_in_run_is_made_once(recorded):
    case = load_case(recorded / "case.json")
    calls: list[tuple[str, str]] = []

    def runner(c, name):
        calls.append((name, c.spec["dtype"]))
        return run_impl(c, name)

    names = [f"recorded:{recorded / n}.npz" for n in ("ddp", "single", "buggy")]
    results = noise_or_bug_all(case, names, runner)
    assert [r.status for r in results] == ["parity", "divergence"]
    assert [r.sides[1].name for r in results] == names[1:] and all(r.sides[0].name == names[0] for r in results)
    # 3 recorded runs; the stand-ins torch.ddp (ddp's and buggy's) and torch.single, each in float32 and float64
    assert sorted(calls) == sorted([(n, "float32") for n in names] + [(s, d) for s in ("torch.ddp", "torch.single")
                                                                     for d in ("float32", "float64")]), calls


def test_two_recorded_runs_beside_a_runnable_one_are_refused_before_anything_runs(recorded, capsys):
    # the pair of the two recorded runs would have no rule to be judged by (the same traceback); a recorded run
    # after a runnable reference named first is judged as ever, so that order is not refused
    ddp, buggy = (f"recorded:{recorded / n}.npz" for n in ("ddp", "buggy"))
    assert main(["compare", str(recorded / "case.json"), "--impls", f"{ddp},{buggy},torch.single"]) == 2
    err = capsys.readouterr().err
    assert "--impls: expected recorded float32 runs either alone" in err and "Traceback" not in err, err
    case = load_case(recorded / "case.json")
    check_recorded_mix(case, ["torch.single", ddp, buggy])                   # runnable first: judged as ever
    check_recorded_mix(case.replace(dtype="float64"), [ddp, buggy, "torch.single"])  # float64: rule 1 judges them


def test_compare_case_called_with_recorded_float32_runs_alone_says_what_judges_them(recorded):
    # the library's compare_case (assert_parity's) is not tfpar compare: it raised judge_perturbation's ValueError
    case = load_case(recorded / "case.json")
    ddp, buggy = (f"recorded:{recorded / n}.npz" for n in ("ddp", "buggy"))
    with pytest.raises(CaseError, match=r"^impls: expected a runnable implementation beside .*noise_or_bug_all"):
        compare_case(case, [ddp, buggy])
    with pytest.raises(CaseError, match="recorded float32 runs either alone"):
        compare_case(case, [ddp, buggy, "torch.single"])
