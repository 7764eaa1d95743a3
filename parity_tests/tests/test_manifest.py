"""Manifests and bit-for-bit replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.contract.case import load_case, write_case
from parity_tests.contract.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.running.manifest import array_digest, build_manifest, load_manifest, replay
from parity_tests.tests.helpers import MLP, make

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
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t.manifest.json")]) == 0
    assert "bit-identical" in capsys.readouterr().out


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
