"""Manifests and bit-for-bit replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.contract.case import load_case, write_case
from parity_tests.protocol.errors import CaseError
from parity_tests.running.environment import versions
from parity_tests.running.gpu import driver_facts, gpu_facts
from parity_tests.running.harness import run_impl
from parity_tests.running.manifest import array_digest, load_manifest
from parity_tests.running.provenance import build_manifest, replay
from parity_tests.tests.helpers import MLP, make


def _driver_now() -> str:
    """This machine's driver as a replay names it (``none`` without one)."""
    return driver_facts()["driver"] or "none"

pytestmark = pytest.mark.usefixtures("pool")


def test_digest_sees_dtype_shape_and_bits():
    a = np.arange(6.0)
    assert array_digest(a) == array_digest(a.copy())
    assert array_digest(a) != array_digest(a.reshape(2, 3))
    assert array_digest(a) != array_digest(a.astype(np.float32))
    b = a.copy()
    b[3] = np.nextafter(b[3], 10)
    assert array_digest(a) != array_digest(b)


def test_run_writes_manifest_and_replay_is_bit_identical(tmp_path, capsys):
    case_json = write_case(make(MLP, parallel__devices=2), tmp_path / "case")
    out = tmp_path / "t.npz"
    assert main(["run", str(case_json), "--impl", "torch.ddp", "--out", str(out)]) == 0
    m = json.loads((tmp_path / "t.manifest.json").read_text())
    for key in ("case", "inputs", "npz_files", "versions", "determinism", "env", "trajectory"):
        assert key in m
    assert "TF_ENABLE_ONEDNN_OPTS" in m["env"] and "CUDA_VISIBLE_DEVICES" in m["env"]
    assert set(m["npz_files"]) == {"weights.npz", "data.npz"}
    assert m["trajectory"]["param/0.kernel"] == array_digest(np.load(out)["param/0.kernel"])
    # the GPU facts (none on a CPU machine, and nothing fails): the torch run's from its rank
    assert m["gpu"]["source"] in (None, "nvidia-smi", "/proc/driver/nvidia") and m["gpu"]["torch"]["live"] is True
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t.manifest.json")]) == 0
    out = capsys.readouterr().out
    assert "bit-identical" in out and "versions differ" not in out  # the same machine: nothing to say
    # the same run recorded elsewhere: an older numpy, a newer driver, another CUDA build of torch
    m["versions"]["numpy"] = "1.26.4"
    m["gpu"]["driver"], m["gpu"]["source"] = "999.1", "nvidia-smi"
    m["gpu"]["torch"]["cuda"] = "12.8"
    doctored = tmp_path / "elsewhere.manifest.json"
    doctored.write_text(json.dumps(m))
    assert main(["replay", str(doctored)]) == 0  # still bit-identical: the versions are said, not judged
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("bit-identical"), lines
    now = versions()
    assert lines[0] == (f"versions differ from the recorded run: numpy {now['numpy']} (recorded 1.26.4); gpu driver"
                        f" {_driver_now()} (recorded 999.1); gpu torch.cuda {gpu_facts()['torch']['cuda'] or 'none'}"
                        " (recorded 12.8)"), lines[0]


def test_replay_names_the_first_array_that_differs(tmp_path):
    case_json = write_case(make(MLP, parallel__devices=2), tmp_path / "case")
    case = load_case(case_json)
    m = build_manifest(case, "tf.towers", run_impl(case, "tf.towers"))

    def nudged(c, impl):  # a run that is one ulp off in one array
        t = run_impl(c, impl)
        t["param/1.bias"] = np.nextafter(t["param/1.bias"], np.inf)
        return t

    same, line = replay(m, nudged)
    assert not same and line.startswith("param/1.bias: first array that differs")


def test_replay_refuses_changed_inputs(tmp_path, capsys):
    case_json = write_case(make(MLP, parallel__devices=2), tmp_path / "case")
    out = tmp_path / "t.npz"
    assert main(["run", str(case_json), "--impl", "tf.single", "--out", str(out)]) == 0
    d = dict(np.load(tmp_path / "case" / "data.npz"))
    d["x"][0, 0] += 1.0
    np.savez(tmp_path / "case" / "data.npz", **d)
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t.manifest.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tfpar: error: npz_files['data.npz']") and "\n" not in err


def test_bad_manifest_is_bad_input(tmp_path, capsys):
    (tmp_path / "m.json").write_text('{"schema": "other"}')
    assert main(["replay", str(tmp_path / "m.json")]) == 2
    assert "schema" in capsys.readouterr().err
    with pytest.raises(CaseError, match="MANIFEST: expected an existing manifest file"):
        load_manifest(tmp_path / "missing.json")


TF_PLUGIN = '''
import tensorflow as tf

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def single(run):
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    run.begin(w)
    lr = run.spec["optimizer"]["lr"]
    for x, y in run.batches():
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.constant(x) @ w["0.kernel"] + w["0.bias"])
            out = h @ w["1.kernel"] + w["1.bias"]
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(y), logits=out))
        g = tape.gradient(loss, w)
        for k in w:
            w[k].assign_sub(lr * g[k])
        run.record(loss, w)
'''


def test_manifest_records_the_implementation_of_a_builtin(tmp_path):
    case = make(MLP, parallel__devices=2)
    traj = {"loss": np.zeros(4), "param/0.kernel": np.zeros((5, 5, 10))}
    m = build_manifest(case, "torch.ddp", traj)
    assert m["schema"] == "tfpar-manifest/1"
    assert m["implementation"] == {"name": "torch.ddp", "kind": "builtin", "framework": "torch", "parallel": True,
                                   "dtypes": ["float32", "float64", "mixed_bfloat16"], "keras": False}
    assert build_manifest(case, "tf.single", traj)["implementation"]["parallel"] is False


def test_a_manifest_without_the_implementation_object_still_replays(tmp_path, capsys):
    case_json = write_case(make(MLP, parallel__devices=2), tmp_path / "case")
    out = tmp_path / "t.npz"
    assert main(["run", str(case_json), "--impl", "tf.single", "--out", str(out)]) == 0
    mpath = tmp_path / "t.manifest.json"
    m = json.loads(mpath.read_text())
    del m["implementation"], m["findings"]  # as written before they existed
    mpath.write_text(json.dumps(m))
    capsys.readouterr()
    assert main(["replay", str(mpath)]) == 0
    assert "bit-identical" in capsys.readouterr().out


def test_plugin_manifest_records_its_source_and_replays_by_location(tmp_path, monkeypatch, capsys):
    import hashlib

    work = tmp_path / "work"
    work.mkdir()
    (work / "my_plugin.py").write_text(TF_PLUGIN)
    case_json = write_case(make(MLP, parallel__devices=1), tmp_path / "case")
    monkeypatch.chdir(work)
    assert main(["run", str(case_json), "--impl", "my_plugin.py:single", "--out", "p.npz"]) == 0
    mpath = work / "p.manifest.json"
    m = json.loads(mpath.read_text())
    source = work / "my_plugin.py"
    assert m["impl"] == "my_plugin.py:single"
    info = m["implementation"]
    assert {k: info[k] for k in ("name", "kind", "framework", "parallel", "dtypes")} == {
        "name": "my_plugin.py:single", "kind": "plugin", "framework": "tf", "parallel": True,
        "dtypes": ["float32", "float64"]}
    assert info["source"] == str(source.resolve())
    assert info["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert info["location"]["path"] == str(source.resolve()) and info["location"]["attr"] == "single"
    monkeypatch.chdir(tmp_path)  # the relative name no longer resolves here: the recorded location does
    capsys.readouterr()
    assert main(["replay", str(mpath)]) == 0
    assert "bit-identical" in capsys.readouterr().out
    source.write_text(TF_PLUGIN.replace("lr * g[k]", "2 * lr * g[k]"))
    assert main(["replay", str(mpath)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tfpar: error: implementation.source: expected the plugin's source")
    assert "changed since the run" in err
    source.unlink()
    assert main(["replay", str(mpath)]) == 2
    assert "no longer exists" in capsys.readouterr().err
