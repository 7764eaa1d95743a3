"""The corpus of real public programs of ``examples/real/``: each port against its counterpart.

Six training programs nobody here wrote (TensorFlow tower scripts, a TF2 ``MirroredStrategy``
custom loop, pytorch/examples DDP programs), each ported as a plugin and paired with a
faithful port in the other framework or with a built-in, run at 1, 2 and 4 devices in
float64 and float32. Each test asserts the verdict that ``examples/real/README.md`` shows
to be TRUE, established outside the verdict under test: a true difference of the original
is asserted with its step and stage together with the parity of the original with that one
thing fixed (an entry point of the same file), so that both directions are checked; a
vacuous comparison is checked against the recorded numbers themselves.

Sizes are the smallest that show each finding (widths of 4 to 16, 8 rows a step, 2 steps);
the cases run in about a second each (README.md has the measured times).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from parity_tests.contract.case import load_case
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "examples" / "real"
DEVICES = (1, 2, 4)
DTYPES = ("float64", "float32")


def _impl(example: str, target: str) -> str:
    """``file.py:function`` of an example folder, as an absolute implementation name."""
    return f"{REAL / example / target.split(':')[0]}:{target.split(':')[1]}"


def _compare(example: str, impls: list[str], devices: int, dtype: str):
    case = load_case(REAL / example / "case.json").replace(**{"parallel.devices": devices, "dtype": dtype})
    names = [_impl(example, i) if ":" in i else i for i in impls]  # "torch.ddp": a built-in
    result = compare_case(case, names)
    return {pair.impl.rsplit(":", 1)[-1] if ":" in pair.impl else pair.impl: pair for pair in result.pairs}, result


def _assert_divergence(pair, summary: str, *, step: int, stage: str) -> None:
    assert pair.verdict.status == "divergence", summary
    assert pair.verdict.first_step == step, summary
    assert pair.localisation is not None and pair.localisation["first_bad_step"] == step, summary
    assert pair.localisation["stage"] == stage, (pair.localisation, summary)


# --------------------------------------------------------------------------------------------
# pytorch/examples distributed/ddp-tutorial-series/multigpu.py: vacuous as written
# --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices", DEVICES)
def test_ddp_tutorial_comparison_is_inconclusive(devices, dtype):
    """``F.cross_entropy`` of a one-column output: nothing moves on either side, so nothing is compared."""
    pairs, result = _compare("ddp-tutorial-multigpu", ["torch_multigpu.py:multigpu", "tf_towers.py:towers"],
                             devices, dtype)
    assert pairs["towers"].verdict.status == "inconclusive", result.summary()


@pytest.mark.usefixtures("pool")
def test_ddp_tutorial_loss_is_minus_zero_and_gradients_zero():
    """The premise of the verdict above, read from the program's own run: loss -0.0, every gradient 0."""
    case = load_case(REAL / "ddp-tutorial-multigpu" / "case.json")
    traj = run_impl(case, _impl("ddp-tutorial-multigpu", "torch_multigpu.py:multigpu"))
    assert np.all(traj["loss"] == 0) and np.all(np.signbit(traj["loss"])), traj["loss"]
    for name in ("weight", "bias"):
        assert np.all(traj[f"grad/{name}"] == 0), name
        assert np.array_equal(traj[f"param/{name}"][-1], traj[f"param/{name}"][0]), name


# --------------------------------------------------------------------------------------------
# pytorch/examples distributed/ddp/example.py against the built-in tf.towers
# --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices", DEVICES)
def test_ddp_toy_example_is_at_parity_with_tf_towers(devices, dtype):
    pairs, result = _compare("ddp-toy-example", ["tf.towers", "torch_example.py:demo_basic"], devices, dtype)
    assert pairs["demo_basic"].verdict.status == "parity", result.summary()


# --------------------------------------------------------------------------------------------
# aymericdamien/TensorFlow-Examples multigpu_cnn.py against the built-in torch.ddp
# --------------------------------------------------------------------------------------------
CNN = ["torch.ddp", "tf_multigpu_cnn.py:multigpu_cnn", "tf_multigpu_cnn.py:multigpu_cnn_float64_adam"]


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices", DEVICES)
def test_multigpu_cnn_displays_the_last_towers_loss_after_the_update(devices, dtype):
    """As written: the loss shown is the last tower's, after the update, and Adam's hyperparameters
    are float32 (found in the float64 runs, stage ``update``); with both fixed, parity."""
    pairs, result = _compare("multigpu-cnn", CNN, devices, dtype)
    _assert_divergence(pairs["multigpu_cnn"], result.summary(), step=1, stage="update")
    assert pairs["multigpu_cnn"].verdict.key == "loss", result.summary()
    assert pairs["multigpu_cnn_float64_adam"].verdict.status == "parity", result.summary()


@pytest.mark.usefixtures("pool")
def test_multigpu_cnn_with_the_loss_fixed_differs_by_float32_adam_hyperparameters_only():
    """The loss line fixed: the loss agrees, the update differs (float32 lr, betas, epsilon in a float64 graph)."""
    pairs, result = _compare("multigpu-cnn", ["torch.ddp", "tf_multigpu_cnn.py:multigpu_cnn_mean_loss"], 4, "float64")
    pair = pairs["multigpu_cnn_mean_loss"]
    _assert_divergence(pair, result.summary(), step=1, stage="update")
    assert pair.verdict.key.startswith("param/"), result.summary()
    assert 1e-9 < pair.verdict.gap < 1e-5, result.summary()  # measured: 3.3e-7


# --------------------------------------------------------------------------------------------
# tensorflow/docs custom_training.ipynb (MirroredStrategy) against a torch DDP port
# --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices", DEVICES)
def test_custom_training_differs_by_kerass_float32_constants(devices, dtype):
    """Keras' Adam casts its betas, and its L2 regulariser its factor, through float32: found at
    step 1 against the exact port; the port that rounds them as Keras does is at parity."""
    pairs, result = _compare("custom-training-mirrored",
                             ["tf_custom_training.py:custom_training", "torch_ddp.py:ddp",
                              "torch_ddp.py:ddp_keras_float32_constants"], devices, dtype)
    _assert_divergence(pairs["ddp"], result.summary(), step=1, stage="update")
    assert pairs["ddp_keras_float32_constants"].verdict.status == "parity", result.summary()


# --------------------------------------------------------------------------------------------
# pytorch/examples imagenet/main.py (ResNet) against a TensorFlow tower port
# --------------------------------------------------------------------------------------------
IMAGENET = ["tf_towers.py:towers", "torch_main.py:main_worker", "torch_main.py:main_worker_ddp",
            "torch_main.py:main_worker_ddp_mean_loss"]


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices", DEVICES)
def test_imagenet_on_a_cpu_trains_without_ddp(devices, dtype):
    """On a CPU the program never wraps the model in DDP: the replicas part at step 1 (not on one
    rank), each having applied its own shard's gradient (stage ``combined_grads``: the ranks' |g|
    differ where DDP's all-reduce gives one); with DDP the loss shown is rank 0's own; with that
    logged as the mean, parity."""
    pairs, result = _compare("imagenet-resnet", IMAGENET, devices, dtype)
    if devices == 1:
        assert {k: p.verdict.status for k, p in pairs.items()} == dict.fromkeys(pairs, "parity"), result.summary()
        return
    as_written = pairs["main_worker"]
    assert as_written.verdict.rule == "replicas in sync", result.summary()
    _assert_divergence(as_written, result.summary(), step=1, stage="combined_grads")
    assert as_written.localisation["device"] == 1, as_written.localisation
    _assert_divergence(pairs["main_worker_ddp"], result.summary(), step=1, stage="record")
    assert pairs["main_worker_ddp_mean_loss"].verdict.status == "parity", result.summary()


# --------------------------------------------------------------------------------------------
# tensorflow/models cifar10_multi_gpu_train.py against a torch DDP port
# --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("devices", DEVICES)
def test_cifar10_float32_moving_averages_read_the_weights_before_the_update(devices):
    """float32 (the program's own dtype: ``tf.nn.lrn`` has no float64 kernel): the moving averages
    race the update and lose, the shown loss is the last tower's; fixed, parity.

    The race is not decided by the graph: TensorFlow's executor has run the averages first in
    almost every run seen (README.md), and after the update once in a fresh clone's ``make test``.
    Which order this run took is read from the runs themselves, outside the verdict under test:
    the as-written run's shadows after step 1 equal the fixed run's (which averages the updated
    weights) exactly when its averages ran after the update. Then only the last tower's loss is
    wrong (``record``), and on one device nothing is.
    """
    pairs, result = _compare("cifar10-multi-gpu",
                             ["torch_ddp.py:ddp", "tf_multi_gpu_train.py:multi_gpu_train",
                              "tf_multi_gpu_train.py:multi_gpu_train_fixed"], devices, "float32")
    as_written, fixed = (result.trajectories[f"{_impl('cifar10-multi-gpu', f'tf_multi_gpu_train.py:{n}')}@float32"]
                         for n in ("multi_gpu_train", "multi_gpu_train_fixed"))
    shadows = [k for k in as_written if k.startswith("state/ema.")]
    assert len(shadows) == 10  # weights and biases of the five layers
    averaged_before = any(not np.array_equal(np.asarray(as_written[k])[1], np.asarray(fixed[k])[1]) for k in shadows)
    if averaged_before:  # the race lost: the shadows average the weights before the update
        _assert_divergence(pairs["multi_gpu_train"], result.summary(), step=1, stage="state")
        assert pairs["multi_gpu_train"].verdict.key == ("loss" if devices > 1 else "state/ema.softmax_linear.biases")
    elif devices > 1:
        _assert_divergence(pairs["multi_gpu_train"], result.summary(), step=1, stage="record")
        assert pairs["multi_gpu_train"].verdict.key == "loss"
    else:
        assert pairs["multi_gpu_train"].verdict.status == "parity", result.summary()
    assert pairs["multi_gpu_train_fixed"].verdict.status == "parity", result.summary()


@pytest.mark.usefixtures("pool")
def test_cifar10_as_written_refuses_float64():
    with pytest.raises(CaseError, match="dtype"):
        _compare("cifar10-multi-gpu", ["torch_ddp.py:ddp", "tf_multi_gpu_train.py:multi_gpu_train"], 2, "float64")


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("devices", DEVICES)
def test_cifar10_with_lrn_in_ops_finds_the_float32_learning_rate(devices):
    """``tf.nn.lrn`` written out, so float64 runs: the schedule's float32 lr is found at step 1
    (stage ``update``), besides the last tower's loss; all three fixes, parity. (In float32
    this version is judged by the same float64 runs; the program's own float32 is the test above.)

    The averages' race is fixed here: TensorFlow's inter-op threads decide it, so a rerun of the
    racy program may take the other order (seen under load: its perturbed reruns then differ by
    2e-4 to 7e-4; the judge then judges it against that run-to-run spread, within which a
    float32-sized learning-rate gap may fall)."""
    pairs, result = _compare("cifar10-multi-gpu",
                             ["torch_ddp.py:ddp", "tf_multi_gpu_train.py:multi_gpu_train_f64_race_fixed",
                              "tf_multi_gpu_train.py:multi_gpu_train_f64_fixed"], devices, "float64")
    _assert_divergence(pairs["multi_gpu_train_f64_race_fixed"], result.summary(), step=1, stage="update")
    assert pairs["multi_gpu_train_f64_fixed"].verdict.status == "parity", result.summary()


@pytest.mark.usefixtures("pool")
def test_cifar10_each_fix_removes_one_difference():
    """Fix 1 (the mean loss shown) leaves the float32 lr (update); fix 2 leaves the race (state).

    The race's gap (relative 1 in the averages) stands whichever order a rerun takes: if the judge's
    one-ulp rerun takes the other one, the runs from the same inputs do not repeat and the gap is
    held against that spread (``comparison.unreproduced``), not called ill-conditioning."""
    pairs, result = _compare("cifar10-multi-gpu",
                             ["torch_ddp.py:ddp", "tf_multi_gpu_train.py:multi_gpu_train_f64_mean_loss",
                              "tf_multi_gpu_train.py:multi_gpu_train_f64_mean_loss_lr"], 4, "float64")
    _assert_divergence(pairs["multi_gpu_train_f64_mean_loss"], result.summary(), step=1, stage="update")
    _assert_divergence(pairs["multi_gpu_train_f64_mean_loss_lr"], result.summary(), step=1, stage="state")
    for pair in pairs.values():
        assert pair.verdict.key != "loss", result.summary()


# --------------------------------------------------------------------------------------------
# the README's commands
# --------------------------------------------------------------------------------------------
def test_readme_commands_name_existing_cases_and_plugins():
    """Every ``tfpar compare`` line of ``examples/real/README.md`` names a case and functions that exist,
    and every plugin file opens with the command that checks it."""
    text = (REAL / "README.md").read_text()
    commands = [shlex.split(line) for line in re.findall(r"^tfpar compare .*$", text, flags=re.M)]
    examples = {p.name for p in REAL.iterdir() if p.is_dir()}
    assert {Path(argv[2]).parent.name for argv in commands} >= examples, "an example without a command in README.md"
    for argv in commands:
        assert (ROOT / argv[2]).is_file(), argv
        for impl in argv[argv.index("--impls") + 1].split(","):
            if ":" in impl:
                path, fn = impl.rsplit(":", 1)
                assert f"def {fn}(" in (ROOT / path).read_text(), impl
    for folder in examples:
        for plugin in (REAL / folder).glob("*.py"):
            source = plugin.read_text()
            if "@tfpar.plugin" in source or "@torchref.plugin" in source:
                assert source.startswith('"""tfpar compare examples/real/'), plugin
