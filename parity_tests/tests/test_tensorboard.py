"""``tfpar compare --tensorboard DIR``: event files written by TensorFlow's summary writer, read back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from parity_tests.cli import main
from parity_tests.tests.helpers import MLP, set_path

pytestmark = pytest.mark.usefixtures("pool")


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in a run folder's event files: ``{tag: {step: value}}``."""
    import tensorflow as tf

    out: dict[str, dict[int, float]] = {}
    for f in sorted(folder.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(f)):
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = float(tf.make_ndarray(v.tensor))
    return out


def test_loss_and_gap_curves_read_back(tmp_path, capsys):
    raw = set_path(set_path(MLP, "parallel.devices", 2), "model.reduction", "sum")  # a predicted difference
    (tmp_path / "case.json").write_text(json.dumps(raw))
    board = tmp_path / "board"
    status = main(["compare", str(tmp_path / "case.json"), "--impls", "torch.ddp,torch.single,tf.towers",
                   "--tensorboard", str(board), "--report", str(tmp_path / "rep")])
    assert status == 0  # sum reduction: DDP divides by N, one process does not (an expected difference: exit 0)
    assert sorted(p.name for p in board.iterdir()) == ["tf.towers", "torch.ddp", "torch.ddp vs tf.towers",
                                                       "torch.ddp vs torch.single", "torch.single"]
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    pairs = {p["impl"]: p for p in report["cases"][0]["pairs"]}
    loss = _scalars(board / "torch.ddp")["loss"]
    assert sorted(loss) == [1, 2, 3, 4]
    ddp_traj = np.load(tmp_path / "rep" / "trajectories" / "torch.ddp_float64.npz")
    assert np.allclose([loss[k] for k in range(1, 5)], ddp_traj["loss"])
    differ = _scalars(board / "torch.ddp vs torch.single")
    same = _scalars(board / "torch.ddp vs tf.towers")
    assert sorted(differ["gap/0.kernel"]) == [0, 1, 2, 3, 4] and differ["gap/0.kernel"][0] == 0.0
    single = np.load(tmp_path / "rep" / "trajectories" / "torch.single_float64.npz")
    a, b = ddp_traj["param/0.kernel"], single["param/0.kernel"]
    want = [np.abs(x - y).max() / max(np.abs(x).max(), np.abs(y).max()) for x, y in zip(a, b, strict=True)]
    assert [differ["gap/0.kernel"][k] for k in range(5)] == pytest.approx(want, rel=1e-6)
    assert pairs["torch.single"]["verdict"]["status"] == "expected_difference"
    # CONTRACT §6: the pair that is not at parity says where the runs part; the pair at parity does not
    loc = pairs["torch.single"]["verdict"]["localisation"]
    assert {"first_bad_step", "stage", "device", "name", "gap", "bound", "explanation"} <= set(loc)
    # a sum, not a mean: the rows, activations agree, the per-device sums combine to N times less (stage chain)
    assert (loc["first_bad_step"], loc["stage"], loc["device"]) == (1, "combined_grads", None)
    assert loc["predicted_stage"] == "combined_grads" and loc["as_predicted"]
    assert "localisation" not in pairs["tf.towers"]["verdict"]
    assert "## Where the runs part" in (tmp_path / "rep" / "report.md").read_text()
    assert max(differ["gap/0.kernel"].values()) > differ["gap/bound"][1]
    assert max(same["gap/1.kernel"].values()) < same["gap/bound"][1]
    assert not list(tmp_path.glob(".board.*"))  # written under a temporary name, renamed into place
