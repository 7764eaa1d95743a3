"""Users' plugins (CONTRACT §5): the protocol, the checks of what they record, and bad input.

The plugins live in ``parity_tests/tests/plugins/`` and are named by path,
as a user names theirs. Every bad-input case goes through the command line's
``main`` and must give exit status 2 and one line naming what was wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.running.registry import resolve
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make, set_path

HERE = Path(__file__).resolve().parent / "plugins"
TF = f"{HERE / 'tf_plugins.py'}"
TORCH = f"{HERE / 'torch_plugins.py'}"

pytestmark = pytest.mark.usefixtures("pool")


def _case_file(tmp_path: Path, raw: dict = MLP, **changes) -> str:
    for k, v in changes.items():
        raw = set_path(raw, k.replace("__", "."), v)
    p = tmp_path / "case.json"
    p.write_text(json.dumps(raw))
    return str(p)


def test_registry_resolves_plugins_and_reads_their_decorators():
    tf_impl, torch_impl, single = resolve(f"{TF}:good"), resolve(f"{TORCH}:ddp"), resolve(f"{TORCH}:single")
    assert (tf_impl.kind, tf_impl.framework, tf_impl.parallel, tf_impl.dtypes) == ("plugin", "tf", True, ("float32", "float64"))
    assert (torch_impl.framework, torch_impl.parallel) == ("torch", True)
    assert (single.framework, single.parallel) == ("torch", False)
    assert resolve(f"{TF}:float32_only").dtypes == ("float32",)  # the decorator's default
    assert tf_impl.source == HERE / "tf_plugins.py"
    assert resolve("tf.towers").kind == "builtin"  # built-ins come from the same registry


@pytest.mark.parametrize("n", [1, 3, 4])
def test_users_tower_code_and_ddp_port_match_each_other_and_the_builtins(n):
    case = make(MLP, parallel__devices=n)  # float64
    result = compare_case(case, [f"{TF}:good", f"{TORCH}:ddp", "torch.ddp", "tf.towers"])
    assert [p.verdict.status for p in result.pairs] == ["parity"] * 3, result.summary()
    assert max(p.verdict.gap for p in result.pairs) < 1e-14


def test_a_single_plugin_is_the_full_batch_reference():
    case = make(MLP, parallel__devices=4)
    result = compare_case(case, [f"{TORCH}:single", "torch.single", f"{TF}:good"])
    assert [p.verdict.status for p in result.pairs] == ["parity", "parity"], result.summary()


def test_a_keras_plugin_gets_the_keras_mapping_on_the_builtin_side_whatever_it_declares():
    """The tool sees the plugin's Keras optimizer (floatx float32: lr held in float32) and runs torch.ddp so."""
    case = make(MLP, parallel__devices=2)  # float64, native SGD, lr 0.01 (not exact in float32)
    for plugin in ("keras_sgd", "keras_sgd_undeclared"):
        p = compare_case(case, ["torch.ddp", f"{TF}:{plugin}"]).pairs[0]
        assert p.verdict.status == "parity", p
        assert p.mapping == "torch.ddp run with optimizer.semantics tf, optimizer.keras_rounding floatx_float32"
        assert p.unmapped_gap > 1e-10  # the rounding is real, and reported beside the verdict
        assert p.residual is not None and p.residual.gap < 1e-14


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_localisation_names_the_step_and_stage_where_the_runs_part(dtype):
    # in float32 the float64 rule decides (both sides declare float64): localisation must read the
    # float64 runs, or float32 rounding (> 1e-10 from step 1) would be named as the first bad step
    case = make(MLP, dtype=dtype, parallel__devices=2, steps=4)
    pair = compare_case(case, ["torch.ddp", f"{TF}:lr_doubled_from_step_3"]).pairs[0]
    assert pair.verdict.status == "divergence"
    where = pair.localisation
    assert (where["first_bad_step"], where["stage"], where["device"]) == (3, "update", None), where
    assert where["explanation"].startswith("step 3: the parameters agree before it; the gradient applied agrees")


def test_plugin_trajectory_holds_what_was_recorded():
    case = make(MLP, parallel__devices=2)
    traj = run_impl(case, f"{TF}:good")
    assert traj["loss"].shape == (4,) and traj["param/0.kernel"].shape == (5, 5, 10)
    assert traj["grad/1.bias"].shape == (4, 1)
    np.testing.assert_array_equal(traj["param/0.kernel"][0], case.init["0.kernel"])


def test_float32_case_runs_a_float32_plugin_in_float32():
    traj = run_impl(make(MLP, dtype="float32", parallel__devices=2), f"{TF}:float32_only")
    assert traj["param/1.kernel"].dtype == np.float32


def test_desynchronised_replicas_are_a_finding_with_step_rank_and_parameter(tmp_path, capsys):
    case = make(MLP, parallel__devices=4)
    traj = run_impl(case, f"{TORCH}:rank1_skips_step_2")
    assert traj.findings and traj.findings[0].startswith("replicas diverged at step 2: rank 1, parameter 0.bias")
    result = compare_case(case, ["torch.ddp", f"{TORCH}:rank1_skips_step_2"])
    v = result.pairs[0].verdict
    assert v.status == "divergence" and v.rule == "replicas in sync" and "rank 1" in v.detail
    status = main(["run", _case_file(tmp_path), "--impl", f"{TORCH}:rank1_skips_step_2", "--out", str(tmp_path / "t.npz")])
    assert status == 1
    assert "replicas diverged at step 2: rank 1" in capsys.readouterr().err


def _failure(err: str) -> tuple[str, list[str]]:
    """``tfpar: run failed: ...`` and the lines after it (the user's frames), from captured stderr."""
    lines = err.splitlines()
    i = max(j for j, line in enumerate(lines) if line.startswith("tfpar: run failed: "))
    return lines[i], lines[i + 1:]


@pytest.mark.parametrize(("impls", "says", "frame"), [
    (f"torch.ddp,{TORCH}:raises_at_step_2", f"{TORCH}:raises_at_step_2 raised at step 2 on rank 0: KeyError: 'lr_schedule'",
     "raise KeyError(\"lr_schedule\")"),
    (f"{TF}:raises_at_step_3,torch.ddp", f"{TF}:raises_at_step_3 raised at step 3: ValueError: the learning rate"
     " schedule ran out", "raise ValueError(\"the learning rate schedule ran out\")"),
    (f"torch.ddp,{TORCH}:raises_before_begin", f"{TORCH}:raises_before_begin raised before step 1 on rank 0:"
     " KeyError: 'lr_schedule'", "return run.spec[\"optimizer\"][\"lr_schedule\"]"),
    (f"{TF}:raises_before_begin,torch.ddp", f"{TF}:raises_before_begin raised before step 1: KeyError: 'lr_schedule'",
     "return run.spec[\"optimizer\"][\"lr_schedule\"]"),
])
def test_a_plugin_that_raises_is_exit_3_one_line_then_the_users_frames(tmp_path, capsys, impls, says, frame):
    status = main(["compare", _case_file(tmp_path), "--impls", impls])
    line, rest = _failure(capsys.readouterr().err)
    assert status == 3 and line == f"tfpar: run failed: {says}"  # an error: nothing could be judged
    assert rest[0] == "Traceback (most recent call last; the tool's frames left out):", rest
    files = [r.split('"')[1] for r in rest if r.startswith('  File "')]
    assert files and all(f.startswith(str(HERE)) for f in files), rest  # the user's file only: no tool frame
    assert any(r.startswith("    " + frame) for r in rest), rest  # the line that raised
    assert rest[-1] == says.split(": ", 1)[1], rest  # and the exception, as Python prints it
    assert not any("parity_tests/running" in r or "tfpar/plugin.py" in r or "torchref/" in r for r in rest), rest


def test_the_pool_survives_a_plugin_that_raises_on_every_rank():
    from parity_tests.running.backends import RunError
    from torchref.pool import get_pool

    case = make(MLP, parallel__devices=4)
    run_impl(case, "torch.ddp")
    pool = get_pool(1)  # the shared pool as it is (a larger size would replace it)
    pids = pool.pids
    with pytest.raises(RunError, match="raised at step 2 on rank 0: KeyError"):
        run_impl(case, f"{TORCH}:raises_at_step_2")
    assert get_pool(1) is pool and pool.alive and pool.pids == pids  # no restart: every rank raised its own error
    run_impl(case, f"{TORCH}:ddp")
    assert pool.pids == pids


def test_a_non_finite_value_is_a_finding_naming_step_and_parameter(tmp_path, capsys):
    status = main(["compare", _case_file(tmp_path), "--impls", f"torch.ddp,{TF}:nan_at_step_2"])
    out = capsys.readouterr().out
    assert status == 1
    assert "step 2" in out and "1.bias" in out and "divergence" in out


# every way a user's plugin can be bad input: exit 2, one line, naming the field and what was wrong
BAD = [
    ("missing-file", f"{HERE / 'nope.py'}:towers", "does not exist"),
    ("missing-module", "no_such_package.towers:train", "no module named 'no_such_package.towers'"),
    ("missing-function", f"{TF}:not_there", "a function named 'not_there'"),
    ("no-decorator", f"{TF}:undecorated", "to carry one of @tfpar.plugin.tensorflow"),
    ("unknown-dtype", f"{HERE / 'bad_dtype.py'}:towers", "unknown dtype 'float16'"),
    ("import-error", f"{HERE / 'import_error.py'}:towers", "ModuleNotFoundError: No module named 'my_missing_dependency'"),
    ("never-begins", f"{TF}:no_begin", "a call to run.begin(params) before the first step"),
    ("a-step-short", f"{TF}:one_step_short", "run.record(...) once per step: 4 call(s) (the case's steps), got '3 call(s)'"),
    ("a-step-extra", f"{TF}:one_step_extra", "got '5 call(s)'"),
    ("extra-name", f"{TF}:extra_name", "step 1 run.record() to report only parameter names (0.bias, 0.kernel, 1.bias, 1.kernel), got '0.kernal'"),
    ("missing-name", f"{TF}:missing_name", "step 1 run.record() to report parameter '1.bias'"),
    ("wrong-shape", f"{TF}:wrong_shape", "parameter '0.kernel' of shape [5, 10]"),
    ("torch-module-imports-tf", f"{HERE / 'torch_imports_tf.py'}:ddp", "imports TensorFlow at its top level"),
    ("float32-only-on-float64", f"{TF}:float32_only", "dtype: expected one of float32"),
]


@pytest.mark.parametrize(("name", "impl", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_plugins_exit_2_with_one_line(tmp_path, capsys, name, impl, says):
    # the module that imports TensorFlow is refused by each rank as it imports it, the same on any
    # number of ranks: one rank proves it (the case's 4 would import TensorFlow 4 times, 28 CPU-s)
    changes = {"parallel__devices": 1} if name == "torch-module-imports-tf" else {}
    status = main(["run", _case_file(tmp_path, **changes), "--impl", impl, "--out", str(tmp_path / "t.npz")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("tfpar: error: "), err
    assert says in err[0], err[0]
    assert "Traceback" not in err[0]
    assert not list(tmp_path.glob("t.*"))  # nothing half-written


def test_a_torch_module_that_imports_tf_is_refused_again_by_the_same_rank(tmp_path):
    """The shared pool's ranks live on between runs (the suite, the pytest plugin, a matrix): the
    second run of the module on rank 0, where TensorFlow is now loaded, is refused as the first
    was, and so is another module that binds TensorFlow at its top level."""
    case = make(MLP, parallel__devices=1)
    other = tmp_path / "another_torch_plugin.py"
    other.write_text((HERE / "torch_imports_tf.py").read_text())
    for impl in (f"{HERE / 'torch_imports_tf.py'}:ddp", f"{HERE / 'torch_imports_tf.py'}:ddp", f"{other}:ddp"):
        with pytest.raises(Exception, match="imports TensorFlow at its top level"):
            run_impl(case, impl)
    run_impl(case, "torch.ddp")  # the rank refused three runs and still serves


def test_compare_refuses_an_undeclared_dtype_before_running_anything(tmp_path, capsys):
    status = main(["compare", _case_file(tmp_path), "--impls", f"torch.ddp,{TF}:float32_only"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"tfpar: error: dtype: expected one of float32 for {TF}:float32_only (the dtypes it"
                                   " declares), got 'float64'"]


def test_an_external_model_is_refused_by_builtins_naming_model(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", **{"lin.weight": np.ones((3, 2))})
    np.savez(tmp_path / "d.npz", x=np.ones((16, 3)), y=np.ones((16, 2)))
    raw = {"name": "ext", "model": {"external": "one linear layer", "loss": "mse"}, "init": {"npz": "w.npz"},
           "data": {"npz": "d.npz", "global_batch": 8}, "optimizer": {"name": "sgd", "lr": 0.1},
           "parallel": {"devices": 2}, "steps": 2}
    (tmp_path / "case.json").write_text(json.dumps(raw))
    status = main(["run", str(tmp_path / "case.json"), "--impl", "torch.ddp", "--out", str(tmp_path / "t.npz")])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("tfpar: error: model: expected a layer list for torch.ddp")
    assert not (tmp_path / "t.npz").exists()


def test_unknown_names_list_what_is_accepted():
    with pytest.raises(CaseError, match=r"tf\.towers.*FILE\.py:FUNCTION, package\.module:FUNCTION or recorded:RUN\.npz"):
        resolve("tf.nope")


def _external_case(tmp_path: Path, devices: int) -> str:
    rng = np.random.default_rng(11)
    np.savez(tmp_path / "init.npz", **{"lin.w": rng.normal(size=(3, 2)), "lin.b": np.zeros(2)})
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(48, 3)), y=rng.normal(size=(48, 2)))
    raw = {"name": "external-linear", "dtype": "float64", "model": {"external": "one linear layer", "loss": "mse"},
           "init": {"npz": "init.npz"}, "data": {"npz": "data.npz", "global_batch": 12},
           "optimizer": {"name": "sgd", "lr": 0.1}, "parallel": {"devices": devices}, "steps": 4}
    (tmp_path / "case.json").write_text(json.dumps(raw))
    return str(tmp_path / "case.json")


@pytest.mark.parametrize("devices", [1, 4])
def test_an_external_model_runs_on_plugins_under_their_own_names(tmp_path, capsys, devices):
    tf_ext, torch_ext = f"{HERE / 'tf_external.py'}:towers", f"{HERE / 'torch_external.py'}:ddp"
    status = main(["compare", _external_case(tmp_path, devices), "--impls", f"{tf_ext},{torch_ext}"])
    out = capsys.readouterr().out
    assert status == 0 and "verdict: PARITY" in out, out
    from parity_tests.contract.case import load_case

    traj = run_impl(load_case(tmp_path / "case.json"), torch_ext)
    assert sorted(traj) == ["grad/lin.b", "grad/lin.w", "loss", "param/lin.b", "param/lin.w"]
    assert traj["param/lin.w"].shape == (5, 3, 2)


def test_an_external_models_array_is_told_its_layout_not_guessed_by_rank(tmp_path, capsys):
    """``run.to_torch(a)`` of an external model's 2-D array cannot know whether it is a kernel (transposed) or a
    table (as it is): bad input in one line naming ``layout=``, exit 2, nothing written (issue 35); with
    ``layout="dense"`` (torch_external.py:ddp) the same model runs (the test above)."""
    out = tmp_path / "t.npz"
    status = main(["run", _external_case(tmp_path, 2), "--impl", f"{HERE / 'torch_external.py'}:ddp_guessing",
                   "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "run.to_torch(a, layout=...) for an external model's 2-D array: 'dense'" in err[0], err
    assert err[0].endswith("its rank alone does not say which, got 'shape [3, 2]'"), err
    assert not out.exists()


def test_an_external_model_keeps_its_own_distributed_sampler(tmp_path, capsys):
    """data.order distributed_sampler for an external model: the DDP program's own DataLoader over
    DistributedSampler (23 rows dealt to 3 ranks, padded to 24) against the towers reading run.batches()."""
    rng = np.random.default_rng(12)
    np.savez(tmp_path / "init.npz", **{"lin.w": rng.normal(size=(3, 2)), "lin.b": np.zeros(2)})
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(23, 3)), y=rng.normal(size=(23, 2)))
    raw = {"name": "external-sampler", "dtype": "float64", "model": {"external": "one linear layer", "loss": "mse"},
           "init": {"npz": "init.npz"},
           "data": {"npz": "data.npz", "global_batch": 6, "order": "distributed_sampler", "rows": 23},
           "optimizer": {"name": "sgd", "lr": 0.1}, "parallel": {"devices": 3}, "steps": 5}
    (tmp_path / "case.json").write_text(json.dumps(raw))
    impls = f"{HERE / 'tf_external.py'}:towers,{HERE / 'torch_external.py'}:ddp_sampler"
    status = main(["compare", str(tmp_path / "case.json"), "--impls", impls])
    out = capsys.readouterr().out
    assert status == 0 and "verdict: PARITY" in out, out


def test_a_tensorflow_graph_error_is_told_by_its_cause_not_by_a_frame_of_its_stack():
    """A tf.compat.v1 graph that runs a node needing an unfed placeholder (the hunt's v1_losses once made its
    optimizer's variables wait on the loss): the message ends with the node's "Original stack trace", whose
    last line is a TensorFlow frame (``File ".../ops.py", line 1221, in from_node_def``)."""
    import tensorflow as tf

    from tfpar.plugin import explain

    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, [2])
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.InvalidArgumentError) as info:
            sess.run(x * 2.0)
    line = explain(info.value)
    assert line.startswith("InvalidArgumentError: You must feed a value for placeholder tensor"), line
    assert "File " not in line and "\n" not in line
    assert explain(KeyError("lr")) == "KeyError: 'lr'"  # any other exception: its last line, as before
