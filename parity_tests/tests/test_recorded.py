"""Recorded runs as implementations (CONTRACT §6): ``recorded:path/run.npz``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.contract.case import case_from_dict, write_case
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.trajectory import save_trajectory
from parity_tests.running.manifest import write_manifest
from parity_tests.running.provenance import build_manifest
from parity_tests.running.registry import resolve
from parity_tests.tests.helpers import MLP, make, set_path

pytestmark = pytest.mark.usefixtures("pool")

TORCH_PLUGIN = '''
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(5, 10)
        self.l1 = torch.nn.Linear(10, 1)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = Net().to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())
    params = lambda: {k: run.to_tf(named[v]) for k, v in NAMES.items()}
    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params())
'''


def _case_file(tmp_path, raw, name="case.json"):
    p = tmp_path / name
    p.write_text(json.dumps(raw))
    return p


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tf.towers run of the MLP case (float64), its case written from the generator seeds."""
    d = tmp_path_factory.mktemp("recorded")
    case = _case_file(d, MLP)
    out = d / "towers.npz"
    assert main(["run", str(case), "--impl", "tf.towers", "--out", str(out)]) == 0
    return out


def test_a_recorded_run_compares_at_parity(recorded, tmp_path, capsys):
    # the same case written elsewhere, under another name, with its arrays in npz files: still the same case
    copy = write_case(make(MLP, name="elsewhere"), tmp_path / "copy")
    capsys.readouterr()
    assert main(["compare", str(copy), "--impls", f"tf.towers,recorded:{recorded}"]) == 0
    out = capsys.readouterr().out
    assert "parity" in out and "verdict: PARITY" in out
    impl = resolve(f"recorded:{recorded}")
    assert (impl.kind, impl.framework, impl.parallel, impl.dtypes, impl.rerunnable) == ("recorded", "tf", True, ("float64",), False)


@pytest.mark.parametrize(("change", "said"), [
    ({"optimizer.lr": 0.02}, "the recorded run's optimizer.lr is 0.01, this case's 0.02"),
    ({"steps": 3}, "the recorded run's steps is 4, this case's 3"),
    ({"parallel.devices": 2}, "the recorded run's parallel.devices is 4, this case's 2"),
    ({"data.seed": 5}, "the recorded run's input array 'x' hashes to"),
    ({"init.seed": 9}, "the recorded run's input array 'init/0."),
])
def test_a_recorded_run_of_another_case_is_bad_input(recorded, tmp_path, capsys, change, said):
    raw = MLP
    for k, v in change.items():
        raw = set_path(raw, k, v)
    other = _case_file(tmp_path, raw)
    capsys.readouterr()
    assert main(["compare", str(other), "--impls", f"recorded:{recorded},tf.towers"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the progress bar is left open on the same line
    assert f"tfpar: error: recorded:{recorded}: expected a run of this case" in err
    assert said in err


def test_missing_file_or_manifest_is_bad_input(recorded, tmp_path, capsys):
    case = _case_file(tmp_path, MLP)
    lone = tmp_path / "lone.npz"
    lone.write_bytes(recorded.read_bytes())  # a trajectory without its manifest
    assert main(["compare", str(case), "--impls", f"tf.towers,recorded:{lone}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tfpar: error: --impls: expected the manifest lone.manifest.json beside lone.npz")
    assert main(["compare", str(case), "--impls", f"tf.towers,recorded:{tmp_path / 'none.npz'}"]) == 2
    assert "none.npz does not exist" in capsys.readouterr().err
    assert main(["run", str(case), "--impl", f"recorded:{lone}", "--out", str(tmp_path / "x.npz")]) == 2
    assert capsys.readouterr().err.startswith("tfpar: error: --impl: expected the manifest")


def _fake_record(tmp_path, case, *, findings=(), name="rec", impl="torch.ddp"):
    """A trajectory and manifest without running anything (arrays shaped as the contract says)."""
    from parity_tests.protocol.trajectory import Trajectory

    steps = case.spec["steps"]
    traj = Trajectory({"loss": np.linspace(1.0, 0.5, steps)})
    for k, v in case.init.items():
        traj[f"param/{k}"] = np.stack([v] * (steps + 1))
    traj.findings.extend(findings)
    out = tmp_path / f"{name}.npz"
    save_trajectory(out, traj)
    write_manifest(tmp_path / f"{name}.manifest.json", build_manifest(case, impl, traj, out.name))
    return out


def test_matching_names_nested_fields_and_keeps_findings(tmp_path):
    case = make(MLP)
    out = _fake_record(tmp_path, case, findings=["rank 2 out of sync at step 3"])
    impl = resolve(f"recorded:{out}")
    assert (impl.framework, impl.keras) == ("torch", False)
    traj = impl.run(case, None)
    assert traj.findings == ["rank 2 out of sync at step 3"] and traj.findings[0].data == {}
    np.testing.assert_array_equal(traj["loss"], np.linspace(1.0, 0.5, 4))
    with pytest.raises(CaseError, match=r"recorded run's model\.layers\[0\]\.units is 10, this case's 11"):
        impl.run(make(MLP, **{"model__layers": [{"type": "dense", "units": 11, "activation": "relu"},
                                                {"type": "dense", "units": 1}]}), None)
    with pytest.raises(CaseError, match=r"recorded run's optimizer\.name is 'sgd', this case's 'momentum'"):
        impl.run(make(MLP, optimizer={"name": "momentum", "lr": 0.01, "momentum": 0.5}), None)
    with pytest.raises(CaseError, match="input array 'x' hashes to"):  # same spec, other data values
        x = case.x.copy()
        x[0, 0] += 1.0
        impl.run(case_from_dict({**MLP, "data": {"arrays": True, "global_batch": 48}, "init": {"arrays": True}},
                                x=x, y=case.y, init=case.init), None)


def test_a_findings_data_survives_its_manifest(tmp_path):
    # what the judge reads of a replica finding (step, rank, parameter, norms) is kept beside its line, not
    # re-read from the words: a recorded run localises as the run itself did (judging.localise._replicas)
    from parity_tests.protocol.trajectory import Finding

    data = {"kind": "replicas", "step": 2, "rank": 1, "name": "0.kernel", "norms": [[0, 4.0], [1, 7.0]]}
    out = _fake_record(tmp_path, make(MLP), findings=[Finding("replicas diverged at step 2: rank 1", data)])
    traj = resolve(f"recorded:{out}").run(make(MLP), None)
    assert traj.findings == ["replicas diverged at step 2: rank 1"] and traj.findings[0].data == data


@pytest.mark.parametrize("bad", [5, "x", [{"kind": "replicas", "rank": 1, "name": "0.kernel"}],
                                 [{"kind": "replicas", "step": "2", "rank": 1, "name": "0.kernel"}],
                                 [{"kind": "replicas", "step": 2, "rank": 1, "name": "0.kernel", "norms": [[0]]}]])
def test_a_hand_edited_findings_data_is_dropped_not_read(tmp_path, bad):
    # a manifest whose finding_data is not what the tool writes keeps the finding's line (still a divergence) without
    # the data, never a traceback when the judge reads it
    import json

    out = _fake_record(tmp_path, make(MLP), findings=["replicas diverged at step 2: rank 1"])
    mpath = tmp_path / f"{out.stem}.manifest.json"
    m = json.loads(mpath.read_text())
    m["finding_data"] = bad
    mpath.write_text(json.dumps(m))
    traj = resolve(f"recorded:{out}").run(make(MLP), None)
    assert traj.findings == ["replicas diverged at step 2: rank 1"] and traj.findings[0].data == {}


def test_keras_rounding_is_accepted_from_a_keras_run_only(tmp_path):
    case = make(MLP)
    rounded = case.replace(**{"optimizer.lr": float(np.float32(0.01))})  # what the judge's Keras mapping asks for
    keras = resolve(f"recorded:{_fake_record(tmp_path, case, name='towers', impl='tf.towers')}")
    assert keras.keras and keras.run(rounded, None)["loss"].shape == (4,)  # Keras rounds lr itself: the same run
    torch = resolve(f"recorded:{_fake_record(tmp_path, case, name='ddp')}")
    with pytest.raises(CaseError, match="optimizer.lr is 0.01, this case's 0.009999.*Keras' float32-rounded"):
        torch.run(rounded, None)


def test_a_changed_trajectory_is_refused(tmp_path, capsys):
    case = make(MLP)
    out = _fake_record(tmp_path, case)
    z = dict(np.load(out))
    z["loss"][1] += 1e-12
    np.savez(out, **z)
    with pytest.raises(CaseError, match="'loss' in rec.npz hashes differently"):
        resolve(f"recorded:{out}")


def test_a_recorded_plugin_run(tmp_path, capsys):
    plugin = tmp_path / "my_ddp.py"
    plugin.write_text(TORCH_PLUGIN)
    case = _case_file(tmp_path, MLP)
    out = tmp_path / "plugin.npz"
    assert main(["run", str(case), "--impl", f"{plugin}:ddp", "--out", str(out)]) == 0
    m = json.loads((tmp_path / "plugin.manifest.json").read_text())
    assert m["implementation"]["kind"] == "plugin" and m["implementation"]["framework"] == "torch"
    impl = resolve(f"recorded:{out}")
    assert (impl.kind, impl.framework, impl.parallel) == ("recorded", "torch", True)
    capsys.readouterr()
    assert main(["compare", str(case), "--impls", f"torch.ddp,recorded:{out}"]) == 0
    assert "verdict: PARITY" in capsys.readouterr().out


def test_a_recorded_float32_run_is_judged_by_the_live_sides_floor(tmp_path):
    from parity_tests.running.harness import run_impl
    from parity_tests.session.comparison import compare_case

    case = make(MLP, dtype="float32")
    traj = run_impl(case, "torch.ddp")
    out = tmp_path / "ddp32.npz"
    save_trajectory(out, traj)
    write_manifest(tmp_path / "ddp32.manifest.json", build_manifest(case, "torch.ddp", traj, out.name))
    assert resolve(f"recorded:{out}").dtypes == ("float32",)
    result = compare_case(case, ["torch.ddp", f"recorded:{out}"])
    assert result.parity, result.summary()
    assert not any(k.startswith(f"recorded:{out}@float64") for k in result.trajectories)  # never asked to re-run
