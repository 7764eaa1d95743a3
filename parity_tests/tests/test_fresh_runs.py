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

import numpy as np
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
                 "op determinism off", "numpy's global generator", "the default graph holds",
                 "keras epsilon 0.001 / image data format channels_first", "keras global random seed",
                 "tf.random's global generator", "TensorFloat-32 off", "soft device placement off",
                 "device policy explicit", "XLA jit", "grappler options", "device placement logging"):
        assert kind in line, (kind, line)


def test_a_torch_rank_is_reset_before_and_after_each_run(pool):
    from parity_tests.tests.plugins import fresh_state_torch

    [(without, after)] = pool.run(fresh_state_torch.premise, 7, 1)
    for kind in ("module state", "default dtype torch.float64", "deterministic algorithms off", "2 intra-op threads",
                 "grad mode off", "float32 matmul precision", "torch's generator", "numpy's global generator",
                 "Python's global generator", "a process group an earlier run created", "TF32 matmuls on",
                 "cuDNN TF32 off", "mkldnn matmuls in bf16", "mkldnn off", "fp16 reduced-precision reductions off",
                 "subnormals flushed", "warn_always on", "autograd multithreading off",
                 "fill_uninitialized_memory off", "opt_einsum off"):
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


FLOATX = f"{HERE / 'fresh_state_tf.py'}:floatx_alone"

FRESH_PY = """
import json, sys
import numpy as np
from parity_tests.running.backends import tf_module
tf_module()  # the case's devices and op determinism, as the tool sets them for every run
import keras
from parity_tests.contract.case import case_from_dict
from parity_tests.running.plugins import assemble
from tfpar.plugin import PluginRaised, run_plugin
case = case_from_dict(json.loads(sys.argv[1]))
sys.path.insert(0, sys.argv[2])
import fresh_state_tf
if sys.argv[4] == "cached":
    keras.config.dtype_policy()  # what any Keras object made before the program's set_floatx does
np.random.seed(case.spec["seed"])
try:
    traj = assemble(run_plugin(fresh_state_tf.floatx_alone, case.payload()), case.spec, case.init, "floatx_alone")
except PluginRaised as e:
    print(e.line)
else:
    np.savez(sys.argv[3], **traj)
    print("ran")
"""


def _fresh_python(case: dict, out: Path, how: str) -> str:
    got = subprocess.run([sys.executable, "-c", FRESH_PY, json.dumps(case), str(HERE), str(out), how],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    return got.stdout.strip().splitlines()[-1] if got.stdout.strip() else got.stderr[-2000:]


def test_a_keras_program_that_sets_floatx_alone_runs_in_float64_as_in_a_fresh_python(tmp_path):
    """Issue 35: ``keras.config.set_floatx("float64")`` alone, no ``set_dtype_policy``. Its float64 run under
    the tool is bit for bit its run in a fresh ``python`` (float64 throughout), and the premise: in a process
    whose global dtype policy Keras had already made (float32), the same program fails as reported."""
    from parity_tests.contract.case import case_from_dict
    from parity_tests.running.harness import run_impl

    case = {**CASE, "dtype": "float64"}
    ran = run_impl(case_from_dict(case), FLOATX)
    assert _fresh_python(case, tmp_path / "fresh.npz", "fresh") == "ran"
    with np.load(tmp_path / "fresh.npz") as fresh:
        assert sorted(fresh.files) == sorted(ran)
        for key in fresh.files:
            assert fresh[key].dtype == np.float64, key
            np.testing.assert_array_equal(ran[key], fresh[key], err_msg=key)
    line = _fresh_python(case, tmp_path / "cached.npz", "cached")
    assert "AddV2" in line and "float32" in line and "float64" in line, line


def test_a_plugin_run_starts_with_the_framework_state_of_a_fresh_python(tmp_path, monkeypatch):
    """Every setting a program can change that the tool does not set itself (``fresh_state_tf.describe``:
    Keras' floatx, epsilon, image format and global state, dtype policy included; TensorFlow's eager and
    ``tf.config`` options, seeds and generators) is, at a plugin's start, what ``import keras`` leaves in
    a fresh ``python``; the premise: the comparison sees a dtype policy that Keras has made."""
    from parity_tests.contract.case import case_from_dict
    from parity_tests.running.harness import run_impl

    out = tmp_path / "state.json"
    monkeypatch.setenv("FRESH_STATE_OUT", str(out))
    run_impl(case_from_dict(CASE), f"{HERE / 'fresh_state_tf.py'}:reports_state")
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import keras, fresh_state_tf as m;"
              " keras.config.dtype_policy() if sys.argv[2] == 'cached' else None; print(json.dumps(m.describe()))")
    fresh, cached = (json.loads(subprocess.run([sys.executable, "-c", script, str(HERE), how], capture_output=True,
                                               text=True, timeout=300, cwd=ROOT).stdout.strip().splitlines()[-1])
                     for how in ("fresh", "cached"))
    assert json.loads(out.read_text()) == fresh
    assert cached != fresh and "dtype_policy" in cached["keras"]["global_state"]


def test_restore_puts_keras_back_as_the_snapshot_took_it():
    """``tfpar.fresh``: what the server's child does before a run, here in one process. After a program
    set floatx, made the global dtype policy (cached as float64), moved the name counters and set Keras'
    seed, :func:`restore` gives back ``import keras``'s state: no policy cached, floatx float32, names anew."""
    import keras
    from keras.src.backend.common import global_state

    from tfpar.fresh import restore, snapshot

    saved = snapshot()
    try:
        keras.config.set_floatx("float64")
        global_state.set_global_attribute("dtype_policy", None)  # whatever this process made before
        keras.config.dtype_policy()  # cached now, from floatx
        keras.config.set_epsilon(1e-3)
        keras.utils.set_random_seed(5)
        before = keras.layers.Dense(1).name
        assert global_state.get_global_attribute("dtype_policy").name == "float64"  # the premise
    finally:
        restore(saved)
    assert keras.config.floatx() == saved["config"]["_FLOATX"] and keras.config.epsilon() == saved["config"]["_EPSILON"]
    assert dict(vars(global_state.GLOBAL_STATE_TRACKER)) == saved["state"]
    assert keras.layers.Dense(1).name == before  # the counter started again where the snapshot had it
    restore(saved)
