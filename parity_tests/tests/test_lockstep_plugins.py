"""``--lockstep`` with plugins and any optimizer: the run object hands over the reference's optimizer state (issue 26, item 4).

``optim_tf.towers`` (a Keras optimizer) and ``optim_torch.ddp`` (``torch.optim``) call
``run.use_optimizer``; from the states of two interleaved chains each repeats each chain's
steps bit for bit (the state is loaded exactly: slots, step counter), and each is at
lockstep parity with the built-in that runs the same framework's class.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.protocol.errors import CaseError
from parity_tests.session import lockstep as ls
from parity_tests.tests.helpers import MLP, make, set_path
from parity_tests.tests.test_lockstep import _alternating

HERE = Path(__file__).resolve().parent / "plugins"
TF = f"{HERE / 'optim_tf.py'}:towers"
TORCH = f"{HERE / 'optim_torch.py'}:ddp"

pytestmark = pytest.mark.usefixtures("pool")

OPTIMIZERS = {
    "adam": {"name": "adam", "lr": 0.05},
    "rmsprop-centered-momentum": {"name": "rmsprop", "lr": 0.01, "centered": True, "momentum": 0.5, "semantics": "torch"},
    "adagrad": {"name": "adagrad", "lr": 0.05},
    "adadelta (plugins only)": {"name": "adadelta", "lr": 1.0, "rho": 0.9, "epsilon": 1e-6},
    # Keras' CosineDecay follows iterations; the torch plugin's SequentialLR goes through use_optimizer(scheduler=)
    "adam-warmup-cosine": {"name": "adam", "lr": 0.05, "schedule": {"kind": "warmup_cosine", "warmup_steps": 2,
                                                                   "decay_steps": 1, "min_lr": 0.01}},
}


@pytest.mark.parametrize("impl", [TF, TORCH])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_plugin_repeats_each_chains_steps_from_the_state_it_is_handed(name, impl):
    case = make(MLP, parallel__devices=2, steps=4, optimizer=OPTIMIZERS[name])
    other = make(MLP, parallel__devices=2, steps=4, optimizer=OPTIMIZERS[name], init__seed=99)
    want, got = _alternating(case, other, impl)
    for k, (a, b) in enumerate(zip(want, got, strict=True)):
        assert set(a) == set(b) and any(key.startswith("opt/") and key != "opt/step" for key in a), sorted(a)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {k + 1}, {key}")
    assert int(want[-1]["opt/step"]) == 4


@pytest.mark.parametrize(("impls", "optimizer"), [
    (["tf.towers", TF], {"name": "adam", "lr": 0.05}),
    (["torch.ddp", TORCH], {"name": "adam", "lr": 0.05}),
    (["torch.ddp", TORCH], {"name": "adagrad", "lr": 0.05}),
    (["tf.towers", TF], OPTIMIZERS["adam-warmup-cosine"]),
    (["torch.ddp", TORCH], OPTIMIZERS["adam-warmup-cosine"]),
])
def test_lockstep_parity_with_the_builtin_of_the_same_framework(impls, optimizer):
    case = make(MLP, parallel__devices=2, steps=3, optimizer=optimizer)
    result = ls.lockstep_compare(case, impls, free=False)
    assert [p.status for p in result.pairs] == ["parity"], result.summary()


def test_two_plugins_in_lockstep_with_an_optimizer_only_they_know(tmp_path, capsys):
    import json

    raw = set_path(set_path(set_path(MLP, "optimizer", OPTIMIZERS["adadelta (plugins only)"]), "steps", 3),
                   "parallel.devices", 2)
    path = tmp_path / "case.json"
    path.write_text(json.dumps(raw))
    second = f"{HERE / 'optim_torch.py'}:ddp_twin"
    assert main(["compare", str(path), "--impls", f"{TORCH},{second}", "--lockstep"]) == 0, capsys.readouterr()


def test_a_plugin_that_does_not_hand_its_optimizer_over_is_one_line(tmp_path):
    case = make(MLP, parallel__devices=2, steps=2, optimizer={"name": "adam", "lr": 0.05})
    with pytest.raises(CaseError, match=r"run.use_optimizer\(optimizer, params\) before the first step"):
        ls.lockstep_compare(case, ["torch.ddp", f"{HERE / 'optim_torch.py'}:ddp_without_handover"], free=False)
