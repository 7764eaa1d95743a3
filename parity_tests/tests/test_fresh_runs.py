"""Every run of a plugin starts as in a fresh process (issue 26, item 1; docs/plugins.md "Every run starts clean").

The plugins of ``tests/plugins/fresh_state_tf.py`` and ``fresh_state_torch.py`` raise at their
start when anything a program sets process-wide is not as a fresh process has it, and leave
every such thing changed after their last step. A float32 comparison runs each twice (float64,
then float32) in the tool's processes; the premise tests show that the checks see each kind of
state when it is left (the same plugins run twice without the tool's isolation fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.cli import main
from parity_tests.tests.processes import HANG_DEADLINE

HERE = Path(__file__).resolve().parent / "plugins"
TF = f"{HERE / 'fresh_state_tf.py'}:leaves_state"
TORCH = f"{HERE / 'fresh_state_torch.py'}:leaves_state"
ROOT = Path(__file__).resolve().parents[2]

#: dense 4-16 tanh -> dense 3, softmax_ce, SGD with momentum (exact in float32), 2 replicas
CASE = {"schema": "parity-case/1", "name": "fresh", "dtype": "float32",
        "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 16, "activation": "tanh"},
                                                 {"type": "dense", "units": 3}], "loss": "softmax_ce"},
        "init": {"seed": 3, "kind": "glorot_uniform"}, "data": {"generator": "blobs", "seed": 5, "global_batch": 16},
        "optimizer": {"name": "momentum", "lr": 0.0625, "momentum": 0.5},
        "parallel": {"devices": 2, "combine": "grad_mean", "weighting": "by_size"}, "steps": 2}

pytestmark = pytest.mark.usefixtures("pool")


def test_each_run_of_a_plugin_that_leaves_state_starts_clean_on_both_sides(tmp_path, capsys):
    """float32 with float64 declared: each side runs twice (float64, then float32), the TensorFlow side
    in a MirroredStrategy with default cross-device ops (a second one in the same process fails)."""
    case = tmp_path / "case.json"
    case.write_text(json.dumps(CASE))
    status = main(["compare", str(case), "--impls", f"{TF},{TORCH}"])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    assert "verdict: PARITY" in out


PREMISE_TF = """
import json, sys
from parity_tests.running.backends import tf_module
tf_module()
from parity_tests.contract.case import case_from_dict
from tfpar.plugin import PluginRaised, run_plugin
case = case_from_dict(json.loads(sys.argv[1]))
path, _, attr = sys.argv[2].rpartition(":")
sys.path.insert(0, path.rsplit("/", 1)[0])
import fresh_state_tf  # in this process, as the tool did before each run got a process of its own
fn = getattr(fresh_state_tf, attr)
import numpy as np
np.random.seed(case.spec["seed"])  # as the tool seeds it: the first run is clean
run_plugin(fn, case.payload())
try:
    run_plugin(fn, case.replace(dtype="float64").payload())
except PluginRaised as e:
    print(e.line)
"""


def test_premise_the_tensorflow_checks_see_every_kind_of_state_a_run_in_the_same_process_leaves():
    out = subprocess.run([sys.executable, "-c", PREMISE_TF, json.dumps(CASE), TF], capture_output=True, text=True,
                         timeout=HANG_DEADLINE, cwd=ROOT)
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert line.startswith("AssertionError: state left by an earlier run: "), line
    for kind in ("module state", "keras floatx float64", "keras dtype policy mixed_float16", "keras name counters",
                 "eager execution disabled", "run_functions_eagerly", "TensorFlow global seed 1234",
                 "op determinism off", "numpy's global generator", "the default graph holds"):
        assert kind in line, (kind, line)


def test_a_torch_rank_is_reset_before_and_after_each_run(pool):
    from parity_tests.tests.plugins import fresh_state_torch

    [(without, after)] = pool.run(fresh_state_torch.premise, 7, 1)
    for kind in ("module state", "default dtype torch.float64", "deterministic algorithms off", "2 intra-op threads",
                 "grad mode off", "float32 matmul precision medium", "torch's generator", "numpy's global generator",
                 "Python's global generator", "a process group an earlier run created"):
        assert any(s.startswith(kind) for s in without), (kind, without)  # the premise: the check sees it
    assert after == []
    [(_, again)] = pool.run(fresh_state_torch.premise, 7, 1)  # and the rank itself was left clean
    assert again == []


def test_a_torch_plugin_declared_nondeterministic_runs_without_deterministic_algorithms_and_the_next_with():
    from parity_tests.running.harness import run_impl
    from parity_tests.tests.helpers import MLP, make

    case = make(MLP, steps=1, parallel__devices=2)
    nd = f"{HERE / 'nondeterministic_torch.py'}"
    run_impl(case, f"{nd}:declared_off")
    run_impl(case, f"{nd}:declared_on")  # the rank was put back
