"""Lockstep judging: start states carried exactly, per-step bounds, the chaotic case and the late bug.

Sizes are the smallest that show each behaviour: 2 devices, 16-row batches, 4 steps for
the state transfer; 50 steps only where the issue's demonstrations need them (the free
run must have time to go chaotic, the bug to wait for step 40).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.session import lockstep as ls
from parity_tests.tests.helpers import CNN, MLP, POLY, SOFTMAX, make, set_path

PLUGINS = "parity_tests/tests/plugins/lockstep_plugins.py:"


def _params(traj: dict) -> dict:
    return {k: v for k, v in traj.items() if k.startswith(("param/", "state/"))}


# ------------------------------------------------------------------ the state carried from step to step


STATEFUL_CASES = {
    # torch's and Keras' momentum, a step schedule (the scheduler's position travels with the step counter)
    "momentum-torch-schedule": (SOFTMAX, {"optimizer__semantics": "torch",
                                          "optimizer__schedule": {"kind": "step", "boundaries": [2], "values": [0.05, 0.01]}}),
    "momentum-tf": (SOFTMAX, {"optimizer__semantics": "tf"}),
    "adam-native": (POLY, {}),  # Keras' own Adam class, torch.optim.Adam
    "amsgrad-tf": (POLY, {"optimizer__name": "amsgrad", "optimizer__semantics": "tf"}),
    "rmsprop-torch": (SOFTMAX, {"optimizer": {"name": "rmsprop", "lr": 0.01, "semantics": "torch", "centered": True,
                                              "momentum": 0.5}}),
    "adagrad-native": (SOFTMAX, {"optimizer": {"name": "adagrad", "lr": 0.05}}),
    # Keras' CosineDecay reads iterations; torch's SequentialLR is recursive and is replayed to step t
    "momentum-native-cosine": (SOFTMAX, {"optimizer__schedule": {"kind": "warmup_cosine", "warmup_steps": 1,
                                                                 "decay_steps": 2, "min_lr": 0.005}}),
}


def _alternating(case, other, impl):
    """Step k from chain A's state (k odd) or chain B's (k even): what a run must repeat, and what it gave.

    Chains A and B are the same case from different initial weights, so nothing is right unless
    every start state is loaded: parameters, state, slots, the step counter (Adam's bias
    correction) and the schedule's position; and the implementation's own state after step
    k - 1 (chain B's or A's) is never the next start.
    """
    chains = [ls.one_step_runs(c, impl, None) for c in (other, case)]
    starts, want = [], []
    for k in range(case.spec["steps"]):
        src, c = chains[k % 2], (other, case)[k % 2]
        starts.append({"init": c.init, "opt": None} if k == 0 else ls._start(src[k - 1]))
        want.append(src[k])
    return want, ls.one_step_runs(case, impl, starts)


@pytest.mark.parametrize("impl", ["tf.towers", "torch.ddp", "torch.single"])
@pytest.mark.parametrize("name", list(STATEFUL_CASES))
def test_each_start_state_is_loaded_exactly(pool, name, impl):
    """From states of two interleaved chains, an implementation repeats each chain's steps bit for bit."""
    base, changes = STATEFUL_CASES[name]
    case = make(base, parallel__devices=2, steps=4, **changes)
    want, got = _alternating(case, make(base, parallel__devices=2, steps=4, init__seed=99, **changes), impl)
    for k, (a, b) in enumerate(zip(want, got, strict=True)):
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {k + 1}, {key}")
    assert int(want[-1]["opt/step"]) == 4


@pytest.mark.parametrize("impl", ["tf.towers", "torch.ddp"])
def test_the_reference_chain_is_its_free_run(pool, impl):
    """The reference's lockstep sequence is its free run, bit for bit (so its own one-step gap is 0)."""
    case = make(SOFTMAX, parallel__devices=2, steps=4, optimizer__semantics="torch")
    free = run_impl(case, impl)
    chain = ls.one_step_runs(case, impl, None)
    for key, value in _params(free).items():
        np.testing.assert_array_equal(np.stack([value[0]] + [t[key][1] for t in chain]), value, err_msg=key)


def test_momentum_slots_cross_frameworks(pool):
    """torch's momentum buffers loaded into the tower engine (and back) keep parity at every step; without them, not."""
    case = make(SOFTMAX, parallel__devices=2, steps=4, optimizer__semantics="torch")
    result = ls.lockstep_compare(case, ["torch.ddp", "tf.towers", "torch.single"], free=False)
    assert [p.status for p in result.pairs] == ["parity", "parity"]
    assert np.all(result.pairs[0].one_step_gap < 1e-14)  # float64 one-step gaps: rounding only

    # the same comparison with the slots dropped from every start state: step 2 onwards differs
    chain = ls.one_step_runs(case, "torch.ddp", None)
    starts = [{"init": case.init, "opt": None}] + [{**ls._start(t), "opt": None} for t in chain[:-1]]
    b = ls.one_step_runs(case, "tf.towers", starts)
    gap = [np.max(np.abs(chain[k]["param/1.kernel"][1] - b[k]["param/1.kernel"][1])) for k in range(4)]
    assert gap[0] < 1e-14 and min(gap[1:]) > 1e-4


@pytest.mark.parametrize("impl", ["tf.towers", "torch.ddp"])
def test_batch_norm_state_and_dropout_rows_travel(pool, impl):
    """Batch-norm moving statistics are part of the start state, and step k uses step k's dropout masks.

    The chain (no state loaded on tf.towers, every state loaded on torch.ddp) is the free
    run bit for bit, and a run from the states of two interleaved chains repeats each.
    """
    case = make(CNN, parallel__devices=2, steps=3, dtype="float64")
    chain = ls.one_step_runs(case, impl, None)
    assert any(k.startswith("state/") for k in chain[0])
    free = run_impl(case, impl)
    for key, value in _params(free).items():
        np.testing.assert_array_equal(np.stack([value[0]] + [t[key][1] for t in chain]), value, err_msg=key)
    want, got = _alternating(case, make(CNN, parallel__devices=2, steps=3, dtype="float64", init__seed=99), impl)
    for k, (a, b) in enumerate(zip(want, got, strict=True)):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {k + 1}, {key}")


def test_a_predicted_difference_is_found_at_its_step(pool):
    """torch's unbiased running variance: an expected difference in the state, from step 1, in lockstep too."""
    case = make(CNN, parallel__devices=2, steps=2, dtype="float64")
    pair = ls.lockstep_compare(case, ["tf.towers", "torch.ddp"], free=False).pairs[0]
    assert pair.status == "expected_difference" and pair.first_bad_step == 1
    assert pair.key.endswith("moving_variance")


# ------------------------------------------------------------------ the issue's two demonstrations


def _chaotic(steps: int = 50, lr: float = 8.0, outlier: bool = False):
    """A tanh MLP at a large learning rate: float32 rounding grows by orders of magnitude in 50 steps.

    With ``outlier``: inputs within [-3, 3] except one value 8.0 in the 40th global batch,
    the only input ``lockstep_plugins.clamp_inputs`` changes.
    """
    rng = np.random.default_rng(7)
    b = 16
    x = np.clip(rng.normal(size=(steps * b, 5)), -3, 3)
    if outlier:
        x[39 * b + 3, 2] = 8.0
    y = (x.sum(axis=1, keepdims=True) > 0).astype(float)
    raw = MLP
    for k, v in {"dtype": "float32", "steps": steps, "optimizer.lr": lr, "model.layers.0.activation": "tanh",
                 "data": {"arrays": True, "global_batch": b}, "parallel.devices": 2}.items():
        raw = set_path(raw, k, v)
    return case_from_dict(raw, x=x, y=y)


def test_chaotic_free_run_diverges_but_lockstep_says_parity(pool):
    """The free float32 gap grows 100x past the float32 floor (and float64 rounding past 1e-10); every step agrees.

    Both implementations are correct: a chaotic run amplifies rounding from step to step, which the
    free comparison measures (one float64 ulp of the inputs moves each run as far) and calls
    inconclusive, pointing at lockstep; lockstep's per-step bounds hold at every step.
    """
    case = _chaotic()
    result = ls.lockstep_compare(case, ["tf.towers", "torch.ddp"])
    free, pair = result.free.pairs[0], result.pairs[0]
    assert free.verdict.status == "inconclusive" and free.verdict.rule == "float64 conditioning floor"
    assert "ill-conditioned" in free.verdict.detail and "--lockstep" in free.verdict.detail
    assert np.nanmax(pair.free_gap) > 100 * FLOAT32_ABS_FLOOR
    # the free gap at the last step against what rounding explains in one step there
    assert pair.free_gap[-1] > 100 * pair.bound[-1]
    assert pair.status == "parity" and pair.first_bad_step is None
    assert np.all(pair.one_step_gap <= pair.bound)
    assert result.parity
    assert result.ok and not result.free_stands  # a free inconclusive is what lockstep resolves: exit status 0


def test_seeded_bug_at_step_40_is_named_by_lockstep(pool):
    """A bug that fires only in the 40th batch: lockstep names step 40, where the free run names an earlier step."""
    case = _chaotic(outlier=True)
    result = ls.lockstep_compare(case, ["tf.towers", PLUGINS + "clamp_inputs", PLUGINS + "ddp"])
    bug, ok = result.pairs
    assert bug.status == "divergence" and bug.first_bad_step == 40
    assert all(s == "parity" for s in bug.step_status[:39])
    assert ok.status == "parity"  # the same plugin without the clamp
    free = result.free.pairs[0]
    assert free.verdict.status == "inconclusive"  # chaos hides the bug in the free run: it cannot tell
    assert free.localisation["first_bad_step"] == 40  # CONTRACT §6: lockstep's first bad step


# ------------------------------------------------------------------ what lockstep refuses


@pytest.mark.parametrize("changes, impls, field", [
    ({"parallel": {"devices": 2, "combine": "param_mean"}}, ["tf.towers", "torch.ddp"], "parallel.combine"),
    ({"data__order": "distributed_sampler", "parallel__shard": "strided"}, ["tf.towers", "tf.single"], "data.order"),
    ({"optimizer": {"name": "momentum", "lr": 0.1, "momentum": 0.9}}, ["tf.towers", "torch.ddp"], "optimizer.semantics"),
    ({"optimizer": {"name": "adam", "lr": 0.1, "semantics": "torch"}}, ["tf.towers", "tf.v1"], "optimizer"),
    ({"dtype": "float32"}, ["tf.towers", PLUGINS + "ddp_float32"], "dtype"),
], ids=["param_mean", "sampler", "native-momentum", "v1-with-adam", "float32-only-plugin"])
def test_unsupported_cases_are_one_line_naming_the_field(changes, impls, field):
    case = make(MLP, parallel__devices=2, **changes)
    with pytest.raises(CaseError) as e:
        ls.check_lockstep(case, impls)
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_stateless_sgd_runs_on_every_implementation(pool):
    """Plain SGD has no optimizer state: tf.v1 and tf.mirrored take part through one-step runs."""
    case = make(MLP, parallel__devices=2, steps=2)
    result = ls.lockstep_compare(case, ["tf.towers", "tf.v1", "tf.mirrored"], free=False)
    assert [p.status for p in result.pairs] == ["parity", "parity"]


def test_cli_lockstep_report_and_exit_status(pool, tmp_path, capsys, monkeypatch):
    from parity_tests.cli import main
    from parity_tests.contract.case import write_case

    monkeypatch.setattr("torchref.pool.shutdown_pool", lambda: None)  # keep the session's warm pool

    path = write_case(make(SOFTMAX, parallel__devices=2, steps=3, optimizer__semantics="torch"), tmp_path / "c")
    out = tmp_path / "r"
    assert main(["compare", str(path), "--impls", "tf.towers,torch.ddp", "--lockstep", "--report", str(out),
                 "--junit", str(tmp_path / "junit.xml")]) == 0
    assert "lockstep verdict: PARITY" in capsys.readouterr().out
    import xml.etree.ElementTree as ET

    junit = ET.parse(tmp_path / "junit.xml").getroot()  # lockstep's verdicts, which the exit status comes from
    assert [(s.get("name"), s.get("tests"), s.get("failures"), s.get("errors")) for s in junit] == [
        ("softmax (lockstep)", "1", "0", "0")]
    doc = json.loads((out / "report.json").read_text())
    lock = doc["cases"][0]["lockstep"]["pairs"][0]
    assert lock["status"] == "parity" and len(lock["one_step_gap"]) == 3 and lock["first_bad_step"] is None
    assert "## Lockstep" in (out / "report.md").read_text()
    assert (out / "lockstep.png").read_bytes()[:4] == b"\x89PNG"
    bad = write_case(make(MLP, parallel__devices=2, parallel__combine="param_mean"), tmp_path / "p")
    assert main(["compare", str(bad), "--impls", "tf.towers,torch.ddp", "--lockstep"]) == 2
    assert "parallel.combine" in capsys.readouterr().err


def test_a_lockstep_result_reads_as_two_small_tables():
    """``repr``: the free comparison's table and lockstep's one row per pair, no per-step arrays."""
    from parity_tests.judging.theory import Prediction
    from parity_tests.judging.verdict import Verdict
    from parity_tests.session.comparison import CaseResult, PairResult

    steps = np.arange(1.0, 401.0)
    free = CaseResult(make(MLP, parallel__devices=2), ["tf.towers", "torch.ddp"],
                      [PairResult("tf.towers", "torch.ddp", Verdict("parity", "float64 bound", 0.0, 1e-10, None, None,
                                                                   0 * steps, None, "within"), Prediction((), ()))], {}, 2.0)
    pair = ls.LockstepPair("tf.towers", "torch.ddp", "divergence", "float64 bound", 1e-9 * steps, 1e-10 + 0 * steps,
                           ["divergence"] * 400, 1e-11 * steps, 1e-10 + 0 * steps, first_bad_step=2,
                           localisation={"stage": "update", "device": None, "name": "0.kernel"})
    text = repr(ls.LockstepResult(free, [pair], 2.0, 3.0))
    assert "array" not in text and "..." not in text
    lines = text.splitlines()
    assert lines[0].startswith("LockstepResult: case mlp: float64, 2 device(s)") and lines[-4].startswith("lockstep (")
    assert lines[-2].split() == ["tf.towers", "vs", "torch.ddp", "divergence", "2", "4e+03", "40"], lines
    assert lines[-1] == "lockstep verdict: DIVERGENCE (free 2.0 s, lockstep 3.0 s)"
    assert repr(pair) == "LockstepPair(tf.towers vs torch.ddp: divergence, float64 bound, first bad step 2)"
    assert pair.where_line() == "torch.ddp: where: update (0.kernel)"


def test_a_step_run_carrying_its_free_findings_keeps_what_it_read_of_itself():
    """Unit: lockstep's copy of a one-step run that takes its side's free findings keeps the run's ``meta`` (a float64
    run's float32 constants, ``judging.precision_leak``), as ``pair.with_findings`` does."""
    from parity_tests.judging.precision_leak import not_float64
    from parity_tests.protocol.trajectory import Trajectory
    from parity_tests.session.lockstep import _with_found

    run = Trajectory({"loss": np.array([1.0])})
    run.meta["keras_float32_constants"] = [{"what": "keras.regularizers.L2", "name": "l2", "value": 1e-3,
                                            "held": float(np.float32(1e-3)), "dtype": "float64"}]
    out = _with_found(run, ["replicas out of sync"])
    assert out.findings == ["replicas out of sync"] and not_float64(out)
