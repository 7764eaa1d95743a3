"""The bugs users reported in public threads (``examples/wild/``), each caught at its first step and stage.

Every example is a pair of plugins written from a real thread's code at the commit before its fix
(``examples/wild/README.md`` names repository, path, commit and lines): ``buggy`` as it was, ``fixed``
as the fix made it. Here, at the device counts the bug needs (and one where it must vanish), in float64
and float32: the buggy version is a ``divergence`` at the first step where the bug acts, at the stage
where it acts, with the factor the thread reported where it is a constant scale; the fixed version is at
``parity`` with the reference. One ``compare_case`` per row judges both pairs (the reference's runs are
shared), so the file costs a few runs per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from parity_tests.contract.case import load_case
from parity_tests.running.plugins import replica_divergence
from parity_tests.session.comparison import compare_case

WILD = Path(__file__).resolve().parents[2] / "examples" / "wild"


def _impl(example: str, fn: str) -> str:
    plugin = "tf_keras.py" if example.startswith("keras") else "ddp.py"
    return f"{WILD / example / plugin}:{fn}"


@dataclass(frozen=True)
class Row:
    """One example at one device count and dtype, and what the tool must say about its buggy version."""

    example: str
    devices: int
    dtype: str
    reference: str            # a built-in, or a plugin function of the example
    status: str               # the buggy version's verdict
    step: int | None = None   # its first bad step
    stage: str | None = None  # its stage
    factor: str | None = None  # the factor's name in the set-up ("1/N", "N x k"), where it is one
    device: int | None = None  # the device named, where one is

    @property
    def id(self) -> str:
        return f"{self.example}-{self.devices}dev-{self.dtype}"


ROWS = [
    # torchtitan PR #2323: the combination divides by N once more: 1/N, combined_grads, step 1; nothing at N = 1
    Row("torchtitan-ddp-double-average", 4, "float64", "torch.ddp", "divergence", 1, "combined_grads", "1/N"),
    Row("torchtitan-ddp-double-average", 2, "float32", "torch.ddp", "divergence", 1, "combined_grads", "1/N"),
    Row("torchtitan-ddp-double-average", 1, "float64", "torch.ddp", "parity"),
    # FunASR PR #3472: the ranks apply different gradients at step 1 (each rank's combined gradient; rank 1 named)
    Row("funasr-no-sync-first-microbatch", 2, "float64", "torch.ddp", "divergence", 1, "combined_grads", device=1),
    Row("funasr-no-sync-first-microbatch", 4, "float32", "torch.ddp", "divergence", 1, "combined_grads", device=1),
    Row("funasr-no-sync-first-microbatch", 1, "float64", "torch.ddp", "parity"),
    # Automodel #3846: every rank's gradient N x k times the true one (k alone at one rank)
    Row("automodel-dp-size-local-mean", 4, "float64", "torch.ddp", "divergence", 1, "device_grads", "N x k"),
    Row("automodel-dp-size-local-mean", 1, "float32", "torch.ddp", "divergence", 1, "device_grads", "k"),
    # Arctic-Platform PR #119: every rank's gradient 1/N of the true one; nothing at N = 1
    Row("arctic-dp-size-dropped", 4, "float64", "torch.ddp", "divergence", 1, "device_grads", "1/N"),
    Row("arctic-dp-size-dropped", 1, "float64", "torch.ddp", "parity"),
    # transformers PR #34191: each rank's loss normalised per micro-batch: loss, no constant scale
    Row("transformers-ga-token-normaliser", 2, "float64", "fixed", "divergence", 1, "loss"),
    Row("transformers-ga-token-normaliser", 2, "float32", "fixed", "divergence", 1, "loss"),
    # torchtune PR #2172: 1/num_tokens after DDP's average: the gradient applied 1/N of the true one
    Row("torchtune-scale-grads-world-size", 4, "float64", "torch.ddp", "divergence", 1, "combined_grads", "1/N"),
    Row("torchtune-scale-grads-world-size", 1, "float64", "torch.ddp", "parity"),
    # llm.c PR #551 and modded-nanogpt #2: rank 0's own loss logged: only what was recorded differs
    Row("llmc-loss-not-reduced", 2, "float64", "torch.ddp", "divergence", 1, "record"),
    Row("llmc-loss-not-reduced", 1, "float64", "torch.ddp", "parity"),
    Row("modded-nanogpt-loss-logging", 4, "float32", "torch.ddp", "divergence", 1, "record"),
    # llm.c d05e848: the sync flag set after the forward: the ranks apply different gradients at step 1 (rank 1)
    Row("llmc-sync-toggle-after-forward", 2, "float64", "torch.ddp", "divergence", 1, "combined_grads", device=1),
    # DeCLUTR PR #212: all_gather passes no gradient back: every rank's gradient 1/N of its share
    # (against the fixed version: each rank's loss is the gathered batch's, which torch.ddp's l_r is not)
    Row("declutr-all-gather-scale", 4, "float64", "fixed", "divergence", 1, "device_grads", "1/N"),
    Row("declutr-all-gather-scale", 2, "float32", "fixed", "divergence", 1, "device_grads", "1/N"),
    # torchtitan #2972: the summed loss backpropagated: B times at one rank, B/N per rank under DDP
    Row("torchtitan-pp-sum-loss", 1, "float64", "torch.ddp", "divergence", 1, "device_grads", "B"),
    Row("torchtitan-pp-sum-loss", 2, "float64", "torch.ddp", "divergence", 1, "device_grads", "B/N"),
    # keras #19990: decay at micro-step 1 moves the weights the second micro-batch reads: the step's logged loss
    # differs first among the recorded channels; the chain sees micro-batch 1's forward agree and micro-batch 2's
    # first layer 0.9999x (1 - lr x wd): the optimizer acted inside the step, update at step 1
    Row("keras-accumulation-weight-decay", 1, "float64", "tf.towers", "divergence", 1, "update"),
    Row("keras-accumulation-weight-decay", 1, "float32", "tf.towers", "divergence", 1, "update"),
]


def _compare(row: Row):
    case = load_case(WILD / row.example / "case.json").replace(**{"parallel.devices": row.devices, "dtype": row.dtype})
    ref = row.reference if "." in row.reference else _impl(row.example, row.reference)
    impls = [ref, _impl(row.example, "fixed"), _impl(row.example, "buggy")]
    if row.reference == "fixed":
        impls = [ref, _impl(row.example, "buggy")]
    return compare_case(case, impls)


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.slow] if r.example.startswith("keras") else [])
                                 for r in ROWS])  # the TensorFlow plugins fork a fresh process per run: ~45 s
def test_the_buggy_version_is_caught_where_the_bug_acts(row):
    result = _compare(row)
    pairs = {p.impl.rsplit(":", 1)[-1]: p for p in result.pairs}
    if "fixed" in pairs:
        assert pairs["fixed"].verdict.status == "parity", result.summary()
    buggy = pairs["buggy"]
    assert buggy.verdict.status == row.status, result.summary()
    if row.status == "parity":
        return
    where = buggy.localisation
    assert (where["first_bad_step"], where["stage"]) == (row.step, row.stage), where
    if row.device is not None:
        assert where["device"] == row.device, where
        # which ranks applied which gradient (each rank's |g|, rank 0 first), where the replicas parted
        norms = dict(where["ranks"]["norms"])
        assert 0 in norms and row.device in norms and norms[row.device] != norms[0], where
        assert where["gap"] > 0 and "the ranks applied different gradients" in where["explanation"], where
        assert f"rank {row.device} {norms[row.device]:.4g} (" in where["explanation"], where
        assert "chain" not in where, where   # the stage chain may not replace the rank (localise.refinable)
    if row.example.startswith("keras"):  # what the chain saw: micro-batch 2 read the weights decayed once
        assert "micro-batch 2's output of layer 0" in where["explanation"], where
        assert "1 - lr x weight_decay, the weights decayed once more" in where["explanation"], where
    factor = where.get("factor")
    if row.factor is not None:
        assert factor is not None and factor["as"] == row.factor, where
        assert factor["text"] in where["explanation"]
    elif factor is not None:  # where the bug is not a scale, no single factor may be claimed
        assert factor["as"] is None and factor["value"] is None, factor


@pytest.mark.slow
def test_keras_without_weight_decay_differs_first_at_the_update_of_step_1():
    # the other half of keras #19990: with no decay nothing moves between micro-batches, the step's loss and the
    # gradient applied agree, and the step counter advanced per micro-step (Adam's bias correction at t = 2 where
    # the large batch has t = 1) changes the update itself: from the same gradient both sides hold the same
    # m / (sqrt(v) + eps), and only the step size lr sqrt(1 - b2^t) / (1 - b1^t) differs, so every parameter's
    # update is sqrt(1 - b2^2)/(1 - b1^2) over sqrt(1 - b2)/(1 - b1) = 0.7441 times the reference's, exact up to
    # float64 rounding (1e-6: the factor's own residual allowance, judging.factor.RTOL)
    example = "keras-accumulation-weight-decay"
    case = load_case(WILD / example / "case.json").replace(**{"optimizer.weight_decay": 0.0})
    result = compare_case(case, ["tf.towers", _impl(example, "buggy")])
    where = result.pairs[0].localisation
    assert (where["first_bad_step"], where["stage"]) == (1, "update"), result.summary()
    b1, b2 = 0.9, 0.999
    ratio = ((1 - b2 ** 2) ** 0.5 / (1 - b1 ** 2)) / ((1 - b2) ** 0.5 / (1 - b1))
    assert where["factor"]["value"] == pytest.approx(ratio, rel=1e-6), where


def test_every_example_folder_is_in_the_table():
    # noise-or-bug is the worked example of two recorded runs (tests/test_noise.py), not a bug of its own
    assert {p.name for p in WILD.iterdir() if p.is_dir()} - {"noise-or-bug"} == {r.example for r in ROWS}


#: the examples whose case the built-in torch.ddp computes as the fixed version does (transformers' masked
#: token loss is not a case the built-ins express; keras' fixed version meets tf.towers in its rows)
BUILTIN_FIXED = sorted({r.example for r in ROWS} - {"transformers-ga-token-normaliser", "keras-accumulation-weight-decay"})


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("example", BUILTIN_FIXED)
def test_the_fixed_version_computes_what_the_builtin_does(example):
    case = load_case(WILD / example / "case.json")
    result = compare_case(case, ["torch.ddp", _impl(example, "fixed")], stages=False)
    assert result.pairs[0].verdict.status == "parity", result.summary()


def _ranks(norms: list[float], digest_1: str = "x") -> list[dict]:
    rows = [{"p": "a"}, {"p": "b"}]
    return [{"digests": rows if r == 0 else [{"p": "a"}, {"p": digest_1}], "grad_norms": [{"p": g}]}
            for r, g in enumerate(norms)]


def test_a_replica_finding_says_which_ranks_applied_what():
    found = replica_divergence(_ranks([4.0, 7.0]), "x")            # the FunASR review's 4.0 against 7.0
    assert found.startswith("replicas diverged at step 1: rank 1, parameter p")
    assert found.endswith("|g| of p rank 0 4, rank 1 7 (1.75x)")
    same = replica_divergence(_ranks([4.0, 4.0]), "x")            # same norms: said, no rank named apart
    assert same.endswith("every rank applied a gradient of the same norm in p at step 1 (4)")
    assert replica_divergence(_ranks([4.0, 7.0], digest_1="b"), "x") is None   # in sync: no finding
    assert "|g|" not in replica_divergence([{k: v for k, v in r.items() if k != "grad_norms"}
                                            for r in _ranks([4.0, 7.0])], "x")   # no norms recorded: none said


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize(("stages", "stage", "of"), [(True, "device_grads", "per-device gradients"),
                                                     (False, "combined_grads", "combined gradients")])
def test_lockstep_names_the_factor_and_whether_the_loss_alone_shows_it(stages, stage, of):
    # torchtitan #2972 (SGD, one rank): the summed loss backpropagated, every gradient B = 16 times the mean's;
    # with the stage chain the factor is read from its capture, without it from the one-step runs' gradients
    from parity_tests.session.lockstep import lockstep_compare

    example = "torchtitan-pp-sum-loss"
    result = lockstep_compare(load_case(WILD / example / "case.json"), ["torch.ddp", _impl(example, "buggy")],
                              stages=stages)
    pair = result.pairs[0]
    where = pair.localisation
    assert (pair.status, pair.first_bad_step, where["stage"]) == ("divergence", 1, stage), result.summary()
    assert where["factor"]["as"] == "B" and where["factor"]["exact"] == "16" and where["factor"]["of"] == of, where
    assert pair.where_line().endswith(f"; {where['factor']['text']}"), pair.where_line()
    # the free runs' logged losses: SGD is not scale invariant, so the loss shows it at step 2
    assert (where["loss_only"]["detectable"], where["loss_only"]["first_step"]) == (True, 2), where
    rows = result.summary().splitlines()
    assert f"  {pair.impl}: loss alone: {where['loss_only']['text']}" in rows, result.summary()


@pytest.mark.usefixtures("pool")
def test_lockstep_claims_no_factor_where_the_ranks_apply_different_gradients():
    # FunASR #3472 in lockstep: the one-step run's replicas part at its step 1; no factor from rank 0's trajectory
    from parity_tests.session.lockstep import lockstep_compare

    example = "funasr-no-sync-first-microbatch"
    result = lockstep_compare(load_case(WILD / example / "case.json"), ["torch.ddp", _impl(example, "fixed"),
                                                                       _impl(example, "buggy")])
    fixed, buggy = result.pairs
    assert fixed.status == "parity" and fixed.localisation is None, result.summary()
    where = buggy.localisation
    assert (buggy.first_bad_step, where["stage"], where["device"]) == (1, "combined_grads", 1), result.summary()
    assert "factor" not in where and ";" not in buggy.where_line(), where
    assert where["loss_only"]["detectable"] and where["loss_only"]["first_step"] == 3, where
