"""Built-in TensorFlow runs of large models in a forked child of the TensorFlow server (``running/builtins.py``).

The child runs the same ``tfpar.run_case`` on the same payload, so its trajectory must be the in-process
one bit for bit; the threshold is lowered here so that a model small enough for the suite crosses it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parity_tests.protocol.errors import CaseError
from parity_tests.running import builtins
from parity_tests.running.harness import run_impl
from parity_tests.running.tf_worker import get_worker
from parity_tests.tests.helpers import CNN, MLP, make
from parity_tests.tests.processes import children


def _same(a, b) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    assert getattr(a, "findings", None) == getattr(b, "findings", None)  # the run's own findings travel too


@pytest.mark.parametrize("impl", ["tf.towers", "tf.mirrored", "tf.single"])
@pytest.mark.parametrize("model", [MLP, CNN], ids=["mlp", "cnn"])
def test_an_isolated_run_is_the_in_process_run_bit_for_bit(monkeypatch, impl, model):
    case = make(model, steps=2, parallel__devices=2)
    here = run_impl(case, impl)
    monkeypatch.setattr(builtins, "ISOLATE_PARAMETERS", 1)
    server = get_worker().pid
    there = run_impl(case, impl)
    _same(here, there)
    assert children(server) == []  # the run's process exited once it reported (the server waited for it)


def test_the_threshold_counts_parameters(monkeypatch):
    case = make(MLP, steps=1)
    n = sum(int(np.prod(a.shape)) for a in case.init.values())
    monkeypatch.setattr(builtins, "ISOLATE_PARAMETERS", n)
    assert builtins._isolated(case)
    monkeypatch.setattr(builtins, "ISOLATE_PARAMETERS", n + 1)
    assert not builtins._isolated(case)


def test_an_isolated_engine_refuses_in_one_line(monkeypatch):
    # tf.v1 refuses accumulation with batch norm (tfpar.refusals.refuse_v1): run_impl asks before any run
    # (harness.check_refusals), and the run itself, in the child here, refuses the same in one line
    layers = [{"type": "dense", "units": 4}, {"type": "batch_norm"}, {"type": "dense", "units": 1}]
    case = make(MLP, steps=1, parallel__devices=2, parallel__accumulate=2, model__layers=layers)
    monkeypatch.setattr(builtins, "ISOLATE_PARAMETERS", 1)
    with pytest.raises(CaseError, match="parallel.accumulate"):
        run_impl(case, "tf.v1")
    with pytest.raises(CaseError, match="parallel.accumulate"):
        builtins._run_in_child(case, "tf.v1", None)


def test_an_isolated_capture_run_records_what_the_in_process_one_does(monkeypatch):
    case = dataclasses.replace(make(CNN, steps=2, parallel__devices=2), capture=1)
    here = run_impl(case, "tf.towers")
    assert any(key.startswith("device/") for key in here)  # the premise: the captured step's per-device values
    monkeypatch.setattr(builtins, "ISOLATE_PARAMETERS", 1)
    _same(here, run_impl(case, "tf.towers"))


def test_an_isolated_run_reads_its_initial_weights_from_the_payload_file_and_sends_its_capture_as_files(monkeypatch):
    """The child keeps the initial weights as the payload's file (each read where its variable is made, never all
    beside the variables) and sends a captured step as spill files, not pickled whole: the same trajectory."""
    from parity_tests.protocol import rows
    from parity_tests.running import backends

    case = dataclasses.replace(make(CNN, steps=2, parallel__devices=2), capture=1)
    here = run_impl(case, "tf.towers")
    monkeypatch.setattr(builtins, "ISOLATE_PARAMETERS", 1)
    monkeypatch.setattr(backends, "BY_FILE_BYTES", 0)  # every initial weight by file
    old = rows.set_spill_threshold(0)
    try:
        there = run_impl(case, "tf.towers")
    finally:
        rows.set_spill_threshold(old)
    assert isinstance(there["device/grad/0.kernel"], rows.RowArray)
    _same(here, there)
