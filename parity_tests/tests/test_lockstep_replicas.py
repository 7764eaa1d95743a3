"""``--lockstep`` checks the replicas, and its exit status follows the worst verdict printed (issue 35, item 5).

A DDP rank that drops or doubles its update is a divergence at that step in the free comparison
("replicas in sync") and in lockstep, whether the program numbers its steps from
``run.first_step`` (its one-step lockstep run repeats the bug and finds the replicas apart) or
counts them itself (only its free run reaches its step 2: lockstep takes the free run's finding at
its step, ``lockstep.free_findings``). The correct plugin stays at parity in both modes. A free
verdict that says something is wrong is never overruled by lockstep's parity (the exit status is 1);
a free ``inconclusive`` is what lockstep resolves (``test_lockstep.py``, the chaotic run).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity_tests.cli import main
from parity_tests.contract.case import write_case
from parity_tests.session import lockstep as ls
from parity_tests.tests.helpers import MLP, make

PLUGINS = f"{Path(__file__).resolve().parent / 'plugins' / 'lockstep_plugins.py'}:"

pytestmark = pytest.mark.usefixtures("pool")


def _case():
    """float64, 2 ranks, 3 steps of SGD (no optimizer state: a one-step run from run.initial is a lockstep step)."""
    return make(MLP, parallel__devices=2, steps=3)


@pytest.mark.parametrize("plugin", ["rank1_drops", "rank1_doubles", "rank1_drops_own", "rank1_doubles_own"])
def test_a_rank_that_drops_or_doubles_its_step_2_update_is_a_divergence_at_step_2_in_both_modes(plugin):
    result = ls.lockstep_compare(_case(), ["torch.ddp", PLUGINS + plugin])
    free, pair = result.free.pairs[0], result.pairs[0]
    assert free.verdict.status == "divergence" and free.verdict.rule == "replicas in sync", free.verdict.detail
    assert "replicas diverged at step 2: rank 1" in free.verdict.detail
    assert pair.status == "divergence" and pair.first_bad_step == 2, result.summary()
    assert pair.step_status == ["parity", "divergence", "parity"]  # step 3 starts from the reference's state again
    assert "replicas diverged at step 2: rank 1" in pair.detail
    assert not result.ok


def test_the_correct_plugin_is_at_parity_in_lockstep_and_the_reference_can_be_the_plugin():
    """The must-not-fire side: no finding, every step at parity; and as the reference, a bug of the
    reference's own replicas is found the same way (its free runs' findings are the ``a`` side's)."""
    result = ls.lockstep_compare(_case(), ["torch.ddp", PLUGINS + "ddp_own"])
    assert [p.status for p in result.pairs] == ["parity"], result.summary()
    assert result.free.pairs[0].verdict.status == "parity" and result.ok
    assert ls.free_findings(result.free, PLUGINS + "ddp_own") == {}
    result = ls.lockstep_compare(_case(), [PLUGINS + "rank1_drops_own", "torch.ddp"])
    assert [(p.status, p.first_bad_step) for p in result.pairs] == [("divergence", 2)], result.summary()


def test_a_free_divergence_lockstep_cannot_see_stands_and_sets_the_exit_status(tmp_path, capsys, monkeypatch):
    """Every rank doubles its learning rate from its own step 2: the replicas stay in sync, the free run
    diverges at step 2, and lockstep's one-step runs (each the program's "step 1") never double it."""
    monkeypatch.setattr("torchref.pool.shutdown_pool", lambda: None)  # keep the session's warm pool
    path = write_case(_case(), tmp_path / "c")
    status = main(["compare", str(path), "--impls", f"torch.ddp,{PLUGINS}lr_doubled_own", "--lockstep"])
    out = capsys.readouterr().out
    assert "lockstep verdict: PARITY" in out, out  # lockstep, alone, cannot see it
    assert "the free comparison's divergence stands" in out
    assert status == 1


@pytest.mark.parametrize(("plugin", "want"), [("rank1_drops_own", 1), ("ddp_own", 0)])
def test_cli_exit_status_with_lockstep(plugin, want, tmp_path, capsys, monkeypatch):
    """The reported bug: a rank-1 drop printed "lockstep verdict: PARITY" and exited 0."""
    monkeypatch.setattr("torchref.pool.shutdown_pool", lambda: None)
    path = write_case(_case(), tmp_path / "c")
    status = main(["compare", str(path), "--impls", f"torch.ddp,{PLUGINS}{plugin}", "--lockstep"])
    out = capsys.readouterr().out
    assert status == want, out
    assert ("lockstep verdict: DIVERGENCE" if want else "lockstep verdict: PARITY") in out
