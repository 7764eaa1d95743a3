"""The case contract: defaults, generators, and one clear error per bad field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict, load_case, write_case
from parity_tests.protocol.errors import CaseError
from parity_tests.tests.helpers import MLP, POLY, SOFTMAX, make, set_path


def test_defaults_are_filled_in():
    raw = set_path(set_path(MLP, "parallel", {"devices": 2}), "optimizer", {"name": "adam", "lr": 0.1})
    spec = case_from_dict(raw).spec
    assert spec["parallel"] == {"devices": 2, "combine": "grad_mean", "shard": "contiguous", "weighting": "equal"}
    want = {"name": "adam", "semantics": "native", "lr": 0.1, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7}
    assert {k: spec["optimizer"][k] for k in want} == want
    assert spec["model"]["layers"][1] == {"type": "dense", "units": 1, "activation": "none", "use_bias": True}


def test_torch_semantics_default_epsilon_is_torchs():
    spec = make(MLP, optimizer={"name": "adam", "lr": 0.1, "semantics": "torch"}).spec
    assert spec["optimizer"]["epsilon"] == 1e-8


def test_generated_data_shapes_and_rows():
    c = make(MLP)
    assert c.x.shape == (4 * 48, 5) and c.y.shape == (4 * 48, 1)
    assert set(np.unique(c.y)) <= {0.0, 1.0}
    p = make(POLY)
    assert p.x.shape == (192,) and np.allclose(p.y[:, 0], 5 * p.x**2 + 3)
    s = make(SOFTMAX)
    assert s.y.dtype == np.int64 and s.y.min() >= 0 and s.y.max() < 3


def test_same_seed_same_numbers_and_different_seed_different():
    a, b = make(MLP), make(MLP)
    assert np.array_equal(a.x, b.x) and all(np.array_equal(a.init[k], b.init[k]) for k in a.init)
    c = make(MLP, init__seed=99)
    assert not np.array_equal(a.init["0.kernel"], c.init["0.kernel"])


def test_glorot_init_limits_and_zero_bias():
    c = make(SOFTMAX)
    lim = np.sqrt(6 / (4 + 8))
    assert np.abs(c.init["0.kernel"]).max() <= lim and np.all(c.init["0.bias"] == 0)


def test_write_then_load_round_trip(tmp_path):
    c = make(SOFTMAX)
    path = write_case(c, tmp_path / "replay")
    back = load_case(path)
    assert back.spec["model"] == c.spec["model"] and back.spec["optimizer"] == c.spec["optimizer"]
    assert np.array_equal(back.x, c.x) and np.array_equal(back.y, c.y)
    assert all(np.array_equal(back.init[k], c.init[k]) for k in c.init)
    assert json.loads(path.read_text())["init"] == {"npz": "weights.npz"}
    assert not list((tmp_path / "replay").glob(".*tmp"))


def test_npz_weights_are_checked(tmp_path):
    c = make(MLP)
    bad = dict(c.init)
    bad["0.kernel"] = bad["0.kernel"][:, :3]
    np.savez(tmp_path / "w.npz", **bad)
    raw = set_path(MLP, "init", {"npz": "w.npz"})
    with pytest.raises(CaseError, match=r"init\['0.kernel'\]: expected shape \[5, 10\]"):
        case_from_dict(raw, tmp_path)


BAD = [
    ("schema", "parity-case/9", "schema"),
    ("dtype", "float16", "dtype"),
    ("steps", 0, "steps"),
    ("steps", "3", "steps"),
    ("model.layers", [], "model.layers"),
    ("model.layers.0.type", "lstm", "model.layers[0].type"),
    ("model.layers.0.units", -3, "model.layers[0].units"),
    ("model.layers.0.activation", "elu", "model.layers[0].activation"),
    ("model.loss", "hinge", "model.loss"),
    ("model.reduction", "max", "model.reduction"),
    ("model.input_shape", [0], "model.input_shape"),
    ("optimizer.lr", -0.1, "optimizer.lr"),
    ("optimizer.lr", float("nan"), "optimizer.lr"),
    ("optimizer.semantics", "jax", "optimizer.semantics"),
    ("parallel.devices", 0, "parallel.devices"),
    ("parallel.devices", 65, "parallel.devices"),
    ("parallel.combine", "median", "parallel.combine"),
    ("parallel.shard", "random", "parallel.shard"),
    ("parallel.weighting", "inverse", "parallel.weighting"),
    ("data.global_batch", 2, "data.global_batch"),
    ("data.generator", "mnist", "data.generator"),
    ("init.kind", "orthogonal", "init.kind"),
    ("extra_field", 1, "extra_field"),
    ("parallel", ..., "parallel"),
]


@pytest.mark.parametrize(("path", "value", "field"), BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_field_is_named(path, value, field):
    with pytest.raises(CaseError) as info:
        case_from_dict(set_path(MLP, path, value))
    msg = str(info.value)
    assert msg.startswith(field + ":"), msg
    assert "\n" not in msg


def test_too_few_rows(tmp_path):
    c = make(MLP)
    np.savez(tmp_path / "d.npz", x=c.x[:100], y=c.y[:100])
    raw = set_path(MLP, "data", {"npz": "d.npz", "global_batch": 48})
    with pytest.raises(CaseError, match=r"data.x: expected at least steps x global_batch = 4 x 48 = 192 rows"):
        case_from_dict(raw, tmp_path)


def test_labels_out_of_range(tmp_path):
    c = make(SOFTMAX)
    y = c.y.copy()
    y[7] = 3
    np.savez(tmp_path / "d.npz", x=c.x, y=y)
    raw = set_path(SOFTMAX, "data", {"npz": "d.npz", "global_batch": 48})
    with pytest.raises(CaseError, match=r"data.y: expected class labels in \[0, 3\)"):
        case_from_dict(raw, tmp_path)


# scikit-learn 1.9.1's digits.csv.gz, and sha256 of its load_digits().images (as uint8) and .target (as
# uint8), taken from scikit-learn itself (2026-11-23) when the file was copied (data/README.md)
DIGITS_FILE_SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
SKLEARN_IMAGES_SHA256 = "8f26b2bd9d135c256808f68f14fdabddde6d9c7f869ae419704b051f0f14b3b3"
SKLEARN_TARGET_SHA256 = "8ba4f891220f5e4c9c819638d1602d74b83618f167043c6da52a2a247841ddf0"


def test_the_digits_file_is_scikit_learns_and_reads_as_load_digits_does():
    import hashlib

    from parity_tests.contract.generators import DIGITS_FILE, _uci_digits

    assert hashlib.sha256(DIGITS_FILE.read_bytes()).hexdigest() == DIGITS_FILE_SHA256
    images, labels = _uci_digits()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert np.array_equal(images, np.round(images)) and images.min() == 0 and images.max() == 16
    assert hashlib.sha256(images.astype(np.uint8).tobytes()).hexdigest() == SKLEARN_IMAGES_SHA256
    assert hashlib.sha256(labels.astype(np.uint8).tobytes()).hexdigest() == SKLEARN_TARGET_SHA256
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_digits_are_the_real_uci_digits_in_an_mnist_canvas():
    from parity_tests.contract.generators import _uci_digits

    raw = {
        "name": "digits", "dtype": "float64",
        "model": {"input_shape": [28, 28, 1], "layers": [{"type": "flatten"}, {"type": "dense", "units": 10}], "loss": "softmax_ce"},
        "init": {"seed": 1}, "data": {"generator": "digits", "seed": 3, "global_batch": 100},
        "optimizer": {"name": "sgd", "lr": 0.1}, "parallel": {"devices": 1}, "steps": 20,
    }
    c = case_from_dict(raw)
    assert c.x.shape == (2000, 28, 28, 1) and c.y.shape == (2000,)
    images, target = _uci_digits()  # scikit-learn's load_digits(), checked by the test above
    # the border is empty, and each 3x3 block of the 24x24 digit is one pixel of a UCI digit with its label
    assert np.all(c.x[:, :2] == 0) and np.all(c.x[:, 26:] == 0)
    small = c.x[:, 2:26, 2:26, 0][:, ::3, ::3] * 16
    assert np.array_equal(np.kron(small / 16, np.ones((3, 3))), c.x[:, 2:26, 2:26, 0])
    index = {img.tobytes(): int(t) for img, t in zip(images, target, strict=True)}
    assert all(index[s.tobytes()] == y for s, y in zip(small, c.y, strict=True))
    # the first 1797 rows are every digit once
    assert len({s.tobytes() for s in small[:1797]}) == len({img.tobytes() for img in images})


@pytest.mark.parametrize(("changes", "field"), [
    ({"parallel__weighting": "sum"}, "parallel.weighting"),  # with a mean reduction: N times the mean
    ({"parallel__weighting": "sum", "model__reduction": "sum", "parallel__combine": "param_mean"}, "parallel.weighting"),
])
def test_sum_weighting_is_for_a_sum_reduction_on_the_synchronous_paths(changes, field):
    with pytest.raises(CaseError) as e:
        make(MLP, **changes)
    assert e.value.field == field
    assert make(MLP, parallel__weighting="sum", model__reduction="sum").spec["parallel"]["weighting"] == "sum"


def test_a_case_made_from_another_shares_its_initial_weights_and_a_callers_are_copied():
    """A comparison makes a case per dtype, mapping and capture run (``Case.replace``): at 29.5 M parameters a copy
    of the weights is 0.24 GB each, so they are shared. Weights a caller hands over are copied (the caller may
    change them afterwards), and stay writable (a plugin's ``run.init`` may be handed to ``torch.from_numpy``)."""
    case = make(MLP, steps=2)
    other = case.replace(dtype="float64", steps=1)
    assert all(other.init[k] is case.init[k] for k in case.init)
    assert all(other.replace(dtype="float32").init[k] is case.init[k] for k in case.init)
    mine = {k: np.array(v) for k, v in case.init.items()}  # the caller's
    raw = dict(case.spec, init={"arrays": True}, data={"arrays": True, "global_batch": case.spec["data"]["global_batch"]})
    copied = case_from_dict(raw, x=case.x, y=case.y, init=mine)
    assert all(copied.init[k] is not mine[k] and np.array_equal(copied.init[k], mine[k]) for k in mine)
    assert all(v.flags.writeable for v in copied.init.values()) and all(v.flags.writeable for v in case.init.values())
