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
from parity_tests.running.harness import run_impl
from parity_tests.session.noise import noise_or_bug, recorded_pair, stand_in

ROOT = Path(__file__).resolve().parents[2]
CASE = ROOT / "examples" / "wild" / "noise-or-bug" / "case.json"
BUGGY = f"{ROOT / 'examples' / 'wild' / 'torchtitan-ddp-double-average' / 'ddp.py'}:buggy"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, request):
    request.getfixturevalue("pool")
    out = tmp_path_factory.mktemp("noise")
    case = out / "case.json"
    case.write_text(CASE.read_text().replace('"steps": 10', '"steps": 3'))
    for impl, name in (("torch.ddp", "ddp"), ("torch.single", "single"), (BUGGY, "buggy")):
        assert main(["run", str(case), "--impl", impl, "--out", str(out / f"{name}.npz")]) == 0
    return out


def test_two_correct_runs_are_within_rounding(recorded):
    case = load_case(recorded / "case.json")
    names = (f"recorded:{recorded / 'ddp.npz'}", f"recorded:{recorded / 'single.npz'}")
    assert recorded_pair(case, list(names))
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
