"""Bad input, end to end through the ``tfpar`` entry point: exit status 2 and one line naming the field.

A table of malformed cases (missing and extra fields, wrong types, unknown
names, zero and negative sizes, shapes that do not fit, too few rows, labels
out of range, NaN/Inf in data or weights, too many devices, broken npz files,
a case file that is not JSON), and a hypothesis property that mutates a valid
case file at random and checks that the tool answers with its own error or a
result: never a traceback, never a hang.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity_tests.cli import main
from parity_tests.contract.case import case_from_dict
from parity_tests.tests.helpers import MLP, SOFTMAX, set_path

Build = Callable[[Path], list[str]]  # writes files into a folder, returns the argv


def _npz_case(raw: dict, tmp: Path, *, data: dict | None = None, weights: dict | None = None) -> dict:
    """``raw`` switched to npz files written from its own generated arrays, optionally altered."""
    case = case_from_dict(raw)
    d = {"x": case.x, "y": case.y, **(data or {})}
    w = {**case.init, **(weights or {})}
    np.savez(tmp / "data.npz", **{k: v for k, v in d.items() if v is not None})
    np.savez(tmp / "weights.npz", **{k: v for k, v in w.items() if v is not None})
    out = copy.deepcopy(raw)
    out["data"] = {"npz": "data.npz", "global_batch": raw["data"]["global_batch"]}
    out["init"] = {"npz": "weights.npz"}
    return out


def _run(raw: Any, impl: str = "tf.single") -> Build:
    def build(tmp: Path) -> list[str]:
        value = raw(tmp) if callable(raw) else raw
        (tmp / "case.json").write_text(value if isinstance(value, str) else json.dumps(value))
        return ["run", str(tmp / "case.json"), "--impl", impl, "--out", str(tmp / "t.npz")]

    return build


def _mut(path: str, value: Any, base: dict = MLP) -> Build:
    return _run(set_path(base, path, value))


def _x_with(value: float) -> Callable[[Path], dict]:
    def f(tmp: Path) -> dict:
        x = case_from_dict(MLP).x.copy()
        x[3, 2] = value
        return _npz_case(MLP, tmp, data={"x": x})
    return f


def _w_with(name: str, value: Any) -> Callable[[Path], dict]:
    return lambda tmp: _npz_case(MLP, tmp, weights={name: value})


def _file_case(kind: str) -> Callable[[Path], dict]:
    def f(tmp: Path) -> dict:
        raw = _npz_case(MLP, tmp)
        if kind == "missing":
            (tmp / "data.npz").unlink()
        elif kind == "truncated":
            b = (tmp / "data.npz").read_bytes()
            (tmp / "data.npz").write_bytes(b[: len(b) // 2])
        elif kind == "not npz":
            (tmp / "data.npz").write_text("x,y\n1,2\n")
        elif kind == "pickle":
            np.save(tmp / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
            (tmp / "obj.npy").rename(tmp / "data.npz")
        return raw
    return f


def _labels(value: int) -> Callable[[Path], dict]:
    def f(tmp: Path) -> dict:
        y = case_from_dict(SOFTMAX).y.copy()
        y[5] = value
        return _npz_case(SOFTMAX, tmp, data={"y": y})
    return f


W0 = case_from_dict(MLP).init["0.kernel"]

TABLE: list[tuple[str, Build, str]] = [
    # missing fields
    ("missing model", _mut("model", ...), "model"),
    ("missing steps", _mut("steps", ...), "steps"),
    ("missing optimizer.lr", _mut("optimizer.lr", ...), "optimizer.lr"),
    ("missing parallel.devices", _mut("parallel.devices", ...), "parallel.devices"),
    ("missing data.global_batch", _mut("data.global_batch", ...), "data.global_batch"),
    ("missing layer units", _mut("model.layers.0.units", ...), "model.layers[0].units"),
    # extra fields
    ("extra top-level field", _mut("epochs", 3), "epochs"),
    ("extra parallel field", _mut("parallel.nodes", 2), "parallel.nodes"),
    ("extra layer field", _mut("model.layers.0.kernel_init", "he"), "model.layers[0]"),
    ("hyperparameter sgd does not take", _mut("optimizer.beta1", 0.9), "optimizer.beta1"),
    # wrong types
    ("steps as string", _mut("steps", "10"), "steps"),
    ("steps as float", _mut("steps", 2.5), "steps"),
    ("devices as bool", _mut("parallel.devices", True), "parallel.devices"),
    ("lr as string", _mut("optimizer.lr", "0.1"), "optimizer.lr"),
    ("layers not a list", _mut("model.layers", {"type": "dense"}), "model.layers"),
    ("model not an object", _mut("model", [1, 2]), "model"),
    ("input_shape of floats", _mut("model.input_shape", [5.0]), "model.input_shape"),
    ("case is a JSON list", _run([MLP]), "case"),
    # unknown names
    ("unknown layer", _mut("model.layers.0.type", "lstm"), "model.layers[0].type"),
    ("unknown activation", _mut("model.layers.0.activation", "swish"), "model.layers[0].activation"),
    ("unknown loss", _mut("model.loss", "huber"), "model.loss"),
    ("unknown optimizer", _mut("optimizer.name", "lamb"), "optimizer.name"),
    ("unknown semantics", _mut("optimizer.semantics", "jax"), "optimizer.semantics"),
    ("unknown generator", _mut("data.generator", "imagenet"), "data.generator"),
    ("unknown schema", _mut("schema", "parity-case/2"), "schema"),
    ("unknown dtype", _mut("dtype", "bfloat16"), "dtype"),
    ("unknown impl", _run(MLP, impl="jax.pmap"), "--impl"),
    # zero and negative sizes
    ("zero steps", _mut("steps", 0), "steps"),
    ("zero devices", _mut("parallel.devices", 0), "parallel.devices"),
    ("negative units", _mut("model.layers.0.units", -4), "model.layers[0].units"),
    ("zero global batch", _mut("data.global_batch", 0), "data.global_batch"),
    ("negative lr", _mut("optimizer.lr", -1e-9), "optimizer.lr"),
    ("negative input dim", _mut("model.input_shape", [-5]), "model.input_shape"),
    # shapes that do not fit
    ("generator needs 5 features", _mut("model.input_shape", [3]), "model.input_shape"),
    ("poly on a vector input", _mut("model.layers.0", {"type": "poly", "degree": 2}), "model.layers[0]"),
    ("softmax with one class", _run(set_path(SOFTMAX, "model.layers.1.units", 1)), "model.loss"),
    ("batch smaller than devices", _mut("data.global_batch", 3), "data.global_batch"),
    ("batch norm with one row per device", _run(set_path(set_path(set_path(MLP, "model.layers", [
        {"type": "dense", "units": 4}, {"type": "batch_norm"}, {"type": "dense", "units": 1}]),
        "parallel.devices", 8), "data.global_batch", 12)), "data.global_batch"),
    ("model far too large", _run(set_path(set_path(MLP, "model.layers.0.units", 100_000), "model.layers.1.units", 100_000)), "model.layers"),
    ("data x of the wrong width", _run(lambda t: _npz_case(MLP, t, data={"x": case_from_dict(MLP).x[:, :4]})), "data.x"),
    ("data y of the wrong width", _run(lambda t: _npz_case(MLP, t, data={"y": np.zeros((192, 2))})), "data.y"),
    # too few rows, labels out of range
    ("too few data rows", _run(lambda t: _npz_case(MLP, t, data={"x": case_from_dict(MLP).x[:100], "y": case_from_dict(MLP).y[:100]})), "data.x"),
    ("label = k", _run(_labels(3)), "data.y"),
    ("negative label", _run(_labels(-1)), "data.y"),
    ("sigmoid label above 1", _run(lambda t: _npz_case(MLP, t, data={"y": np.full((192, 1), 2.0)})), "data.y"),
    # NaN / Inf in data or weights
    ("NaN in data", _run(_x_with(np.nan)), "data.x"),
    ("Inf in data", _run(_x_with(np.inf)), "data.x"),
    ("NaN in weights", _run(_w_with("0.kernel", np.where(np.eye(5, 10) > 0, np.nan, W0))), "init['0.kernel']"),
    ("NaN in lr", _mut("optimizer.lr", float("nan")), "optimizer.lr"),
    # devices
    # more devices than TensorFlow was started with: test_cli.test_too_many_devices_is_bad_input (the
    # process now starts 64 logical CPU devices, so it simulates a start with 8)
    ("more devices than supported", _mut("parallel.devices", 1000), "parallel.devices"),
    # broken files
    ("data npz missing", _run(_file_case("missing")), "data.npz"),
    ("data npz truncated", _run(_file_case("truncated")), "data.npz"),
    ("data file not npz", _run(_file_case("not npz")), "data.npz"),
    ("data file a pickle", _run(_file_case("pickle")), "data.npz"),
    ("weights missing a parameter", _run(_w_with("1.bias", None)), "init['1.bias']"),
    ("weights misshaped", _run(_w_with("0.kernel", W0.T)), "init['0.kernel']"),
    ("weights with an extra array", _run(_w_with("7.kernel", np.zeros(3))), "init['7.kernel']"),
    ("case file not JSON", _run("{'model': oops"), "CASE"),
    ("case file empty", _run(""), "CASE"),
    ("case file binary", lambda t: (t.joinpath("case.json").write_bytes(b"\x89PNG\x00\xff"), ["run", str(t / "case.json"), "--impl", "tf.single", "--out", str(t / "t.npz")])[1], "CASE"),
]


def test_the_table_is_large_enough():
    assert len(TABLE) >= 40 and len({name for name, _, _ in TABLE}) == len(TABLE)


@pytest.mark.parametrize(("build", "field"), [(b, f) for _, b, f in TABLE], ids=[n for n, _, _ in TABLE])
def test_bad_input_exit_2_one_line_naming_the_field(tmp_path, capsys, build, field):
    argv = build(tmp_path)
    status = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1, err
    assert err[0].startswith(f"tfpar: error: {field}"), err[0]
    assert "Traceback" not in err[0]
    assert not (tmp_path / "t.npz").exists()  # nothing half-written


# ---------------------------------------------------------------- mutated case files

_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**7), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(-2, 6), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_cases(draw) -> dict:
    raw = copy.deepcopy(draw(st.sampled_from([MLP, SOFTMAX])))
    raw["steps"] = 2
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(raw)
        path = draw(st.sampled_from(paths))
        node = raw
        for p in path[:-1]:
            node = node[p]
        if draw(st.booleans()) and isinstance(node, dict):
            node.pop(path[-1], None)
        else:
            node[path[-1]] = draw(_VALUES)
    return raw


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutated_cases())
def test_mutated_case_files_get_an_answer_never_a_traceback(tmp_path_factory, raw):
    tmp = tmp_path_factory.mktemp("mut")
    try:
        text = json.dumps(raw, allow_nan=True)  # NaN/Infinity: what a hand-edited file can hold
    except (TypeError, ValueError):
        return
    (tmp / "case.json").write_text(text)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["run", str(tmp / "case.json"), "--impl", "tf.single", "--out", str(tmp / "t.npz")])
    lines = err.getvalue().strip().splitlines()
    assert status in (0, 2), (status, lines)
    if status == 2:
        assert len(lines) == 1 and lines[0].startswith("tfpar: error: "), lines
    else:
        assert (tmp / "t.npz").is_file()
