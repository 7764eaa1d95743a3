"""The data pipeline: TFRecord round trips, tf.data orders, DistributedSampler + DataLoader, and data.order.

TensorFlow and torch are imported inside the tests (``parity_tests`` never imports
them at module level); torch runs of whole cases go through the shared pool.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict, load_case, write_case
from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.judging.theory import predict, sampler_padding
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, MLP, POLY, SOFTMAX, make

RTOL, ATOL = 1e-10, 1e-12  # see test_towers.py for the derivation


@pytest.fixture(scope="module")
def pl():
    """``tfpar.pipeline``, with TensorFlow's devices configured the way the harness does it."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()
    from tfpar import pipeline

    return pipeline


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _sampler_case(base: dict, n: int, rows: int, batch: int, steps: int, **changes) -> object:
    return make(base, parallel__devices=n, parallel__shard="strided", data__order="distributed_sampler",
                data__rows=rows, data__global_batch=batch, steps=steps, **changes)


# ---------------------------------------------------------------- TFRecord files


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (4, 4, 2)], ids=["scalar", "vector", "matrix", "image"])
def test_tfrecord_round_trip_is_bit_exact(pl, tmp_path, dtype, shape):
    rng = np.random.default_rng(7)
    rows = 9
    if dtype == "int64":
        a = rng.integers(-2**62, 2**62, size=(rows, *shape), dtype=np.int64)
        a.reshape(rows, -1)[0, 0] = np.iinfo(np.int64).min
    else:
        a = (rng.normal(size=(rows, *shape)) * 10.0 ** rng.integers(-30, 30, size=(rows, *shape))).astype(dtype)
        flat = a.reshape(rows, -1)
        flat[0, 0] = -0.0  # the sign bit of zero must survive
        flat[1, 0] = np.finfo(dtype).smallest_subnormal
        flat[2, 0] = np.finfo(dtype).max
    labels = np.arange(rows, dtype=np.int64)
    path = tmp_path / "d.tfrecord"
    fields = pl.write_tfrecord(path, {"a": a, "i": labels})
    got = list(pl.read_tfrecord(path, fields).as_numpy_iterator())
    assert [int(r["i"]) for r in got] == list(range(rows))  # file order is row order
    back = np.stack([r["a"] for r in got])
    assert back.dtype == a.dtype and back.shape == a.shape
    assert _bits(back) == _bits(a)


def test_float64_would_not_survive_a_float_list():
    """Why float64 rows are stored as bytes: ``FloatList`` holds float32 (measured: 1/3 moves by 3e-8 relative)."""
    import tensorflow as tf

    a = np.array([1.0 / 3.0, 1e-300])
    stored = np.array(tf.train.Feature(float_list=tf.train.FloatList(value=a)).float_list.value)
    assert stored[0] != a[0] and abs(stored[0] - a[0]) / a[0] > 1e-9
    assert stored[1] == 0.0


def test_seed_pipeline_shuffle_is_deterministic_and_a_permutation(pl, tmp_path):
    rows, batch = 20, 8
    path = tmp_path / "d.tfrecord"
    fields = pl.write_tfrecord(path, {"i": np.arange(rows)})

    def order(seed: int) -> np.ndarray:
        ds = pl.seed_pipeline(pl.read_tfrecord(path, fields), batch, shuffle_buffer=8, seed=seed)
        # 3 epochs = 60 rows = 7.5 batches: batches straddle epochs because repeat() precedes batch()
        return np.concatenate([b["i"] for b in ds.take(8).as_numpy_iterator()])[:3 * rows]

    a, b = order(5), order(5)
    assert np.array_equal(a, b)  # the same seed: the same order, read twice
    epochs = a.reshape(3, rows)
    for e in epochs:
        assert np.array_equal(np.sort(e), np.arange(rows))  # every epoch a permutation of the rows
    assert not np.array_equal(epochs[0], np.arange(rows))  # shuffled...
    assert not np.array_equal(epochs[0], epochs[1])  # ...anew each epoch
    assert not np.array_equal(a, order(6))  # and the seed matters


# ---------------------------------------------------------------- DistributedSampler order


def test_sampler_indices_match_distributed_sampler(pl):
    import torch
    from torch.utils.data import DistributedSampler

    for d in range(1, 14):
        for n in range(1, 6):  # includes d < n, where padding repeats the list more than once
            ds = list(range(d))
            for r in range(n):
                want = list(DistributedSampler(ds, num_replicas=n, rank=r, shuffle=False))
                assert pl.sampler_indices(d, n, r).tolist() == want, (d, n, r)
            # shuffle=True: torch's own draw, given to the numpy order as an explicit permutation
            for epoch in (0, 3):
                g = torch.Generator()
                g.manual_seed(11 + epoch)
                perm = torch.randperm(d, generator=g).numpy()
                for r in range(n):
                    s = DistributedSampler(ds, num_replicas=n, rank=r, shuffle=True, seed=11)
                    s.set_epoch(epoch)
                    assert pl.sampler_indices(d, n, r, perm).tolist() == list(s), (d, n, r, epoch)


@pytest.mark.parametrize(("d", "n"), [(10, 3), (2, 5), (12, 4), (7, 1)])
def test_sampler_dataset_matches_numpy(pl, d, n):
    import tensorflow as tf

    ds = tf.data.Dataset.range(d)
    for r in range(n):
        got = [int(v) for v in pl.sampler_dataset(ds, d, n, r)]
        assert got == pl.sampler_indices(d, n, r).tolist()


@pytest.mark.parametrize("shuffled", [False, True], ids=["unshuffled", "perm"])
@pytest.mark.parametrize(("d", "n", "batch"), [(10, 3, 6), (13, 4, 8), (12, 4, 4), (3, 4, 4)])
def test_tf_global_batches_are_the_torch_loaders_interleaved(pl, tmp_path, d, n, batch, shuffled):
    """tf.data's global batch k == the N ranks' k-th DataLoader batches, row m from rank m mod N."""
    import torch

    from torchref.data import rank_batches, single_batches

    perms = np.random.default_rng(d).permuted(np.tile(np.arange(d), (2, 1)), axis=1) if shuffled else None
    steps = 3 * pl.epoch_steps(d, batch) + 1  # past several epoch ends
    path = tmp_path / "i.tfrecord"
    fields = pl.write_tfrecord(path, {"x": np.arange(d), "y": np.zeros(d, np.int64)})
    tf_batches = pl.sampler_batches(pl.read_tfrecord(path, fields), length=d, num_replicas=n,
                                    per_rank_batch=batch // n, perms=perms)
    x = torch.arange(d)
    loaders = [rank_batches(x, x, num_replicas=n, rank=r, global_batch=batch, perms=perms) for r in range(n)]
    for k, got in enumerate(tf_batches.take(steps).as_numpy_iterator()):
        parts = [next(it) for it in loaders]
        want = torch.stack([p[0] for p in parts], dim=1).reshape(-1).numpy()
        assert got["x"].tolist() == want.tolist(), k
        assert want.tolist() == pl.step_rows(d, batch, k, num_replicas=n, perms=perms).tolist(), k
        # the positions each rank reports are the rows' places in the interleaved global batch
        pos = torch.stack([p[2] for p in parts], dim=1).reshape(-1).numpy()
        assert pos.tolist() == list(range(k * batch, k * batch + len(want)))
    # one process: DataLoader(batch_size=B) and tf.data's batch(B), no padding
    single = single_batches(x, x, global_batch=batch, perms=perms)
    tf_single = pl.loader_batches(pl.read_tfrecord(path, fields), length=d, global_batch=batch, perms=perms)
    for k, got in enumerate(tf_single.take(steps).as_numpy_iterator()):
        want = next(single)[0].numpy()
        assert got["x"].tolist() == want.tolist() == pl.step_rows(d, batch, k, perms=perms).tolist(), k


# ---------------------------------------------------------------- the case field


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"data.order": "random"}, "data.order"),
        ({"data.order": "distributed_sampler", "data.global_batch": 50}, "data.global_batch"),
        ({"data.rows": 30}, "data.rows"),
        ({"data.order": "distributed_sampler", "data.rows": 0}, "data.rows"),
        ({"data.order": "distributed_sampler", "parallel.shard": "contiguous"}, "parallel.shard"),
        ({"data.order": "distributed_sampler", "parallel.combine": "param_mean"}, "data.order"),
    ],
    ids=["unknown-order", "batch-not-multiple-of-N", "rows-with-split", "rows-zero", "contiguous-shard",
         "param-mean"],
)
def test_bad_order_fields_name_the_field(changes, field):
    from parity_tests.tests.helpers import set_path

    raw = SOFTMAX
    for k, v in changes.items():
        raw = set_path(raw, k, v)
    with pytest.raises(CaseError) as e:
        case_from_dict(raw)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("perm", "order", "field"),
    [
        (np.arange(20)[::-1], "split", "data.perm"),
        (np.arange(19), "distributed_sampler", "data.perm"),
        (np.array([[*range(20)], [0, *range(19)]]), "distributed_sampler", "data.perm[1]"),
        (np.arange(20.0), "distributed_sampler", "data.perm"),
    ],
    ids=["perm-with-split", "wrong-length", "not-a-permutation", "float-indices"],
)
def test_bad_perm_names_the_field(tmp_path, perm, order, field):
    import json

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(20, 5)), y=rng.uniform(size=(20, 1)), perm=perm)
    raw = dict(MLP, data={"npz": "data.npz", "global_batch": 4, "order": order}, parallel={"devices": 4})
    if order != "split":
        raw["data"]["rows"] = 20
    (tmp_path / "case.json").write_text(json.dumps(raw))
    with pytest.raises(CaseError) as e:
        load_case(tmp_path / "case.json")
    assert e.value.field == field


def test_order_survives_replace_and_write(tmp_path):
    perm = np.random.default_rng(1).permutation(22)
    case = make(SOFTMAX, data__order="distributed_sampler", data__rows=22, data__global_batch=8)
    assert case.spec["parallel"]["shard"] == "strided"  # DistributedSampler's deal, filled in
    assert case.x.shape[0] == 22  # the dataset, read epoch after epoch
    case = case_from_dict(dict(case.spec, init={"arrays": True}, data=dict(case.spec["data"], arrays=True)),
                          x=case.x, y=case.y, init=case.init, perm=perm)
    changed = case.replace(steps=7)
    assert changed.spec["data"] == case.spec["data"] and np.array_equal(changed.perm, perm[None])
    back = load_case(write_case(changed, tmp_path / "c"))
    assert back.spec["data"]["order"] == "distributed_sampler" and back.spec["data"]["rows"] == 22
    assert np.array_equal(back.perm, perm[None]) and np.array_equal(back.x, case.x)
    assert case_from_dict(SOFTMAX).spec["data"].keys() == {"generator", "seed", "global_batch"}  # split: spec as before


# ---------------------------------------------------------------- trajectories


def _with_perm(case, epochs: int, seed: int):
    """``case`` with an explicit shuffle: ``epochs`` permutations of its rows, drawn in numpy."""
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(len(case.x)) for _ in range(epochs)])
    raw = dict(case.spec, init={"arrays": True}, data=dict(case.spec["data"], arrays=True))
    return case_from_dict(raw, x=case.x, y=case.y, init=case.init, perm=perm)


_FEED_CASES = {
    "mlp-float32-uneven": lambda: make(MLP, dtype="float32", parallel__devices=3, data__global_batch=47),
    "poly-scalar-input": lambda: make(POLY, parallel__devices=4, optimizer__semantics="tf"),
    "cnn-images-dropout-bn": lambda: make(CNN, parallel__devices=2, steps=2),
    "sampler-padded-perm": lambda: _with_perm(_sampler_case(SOFTMAX, 3, 20, 6, 6), 2, 3),
}


@pytest.mark.parametrize("name", list(_FEED_CASES))
def test_tfrecord_feed_is_bit_identical_to_arrays(name):
    """tf.towers (and tf.single) reading through TFRecord + tf.data == fed from the numpy arrays, bit for bit."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()
    import tfpar

    case = _FEED_CASES[name]()
    for impl in ("tf.towers", "tf.single"):
        a = tfpar.run_case(case.payload(), impl, feed="arrays")
        b = tfpar.run_case(case.payload(), impl, feed="tfrecord")
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and _bits(a[k]) == _bits(b[k]), (impl, k)


# ---------------------------------------------------------------- DistributedSampler order across frameworks

# (N, dataset rows D, global batch B): N does not divide D, so each epoch's last step reads
# N ceil(D/N) - D padded rows; the runs cross an epoch boundary (steps > ceil(D/B))
_PADDED = {2: (23, 6), 3: (22, 6), 4: (13, 8)}


@pytest.mark.parametrize(("n", "semantics"), [(2, "torch"), (3, "tf"), (4, "torch")])
def test_sampler_order_tf_towers_equal_ddp(pool, n, semantics):
    rows, batch = _PADDED[n]
    case = _sampler_case(SOFTMAX, n, rows, batch, -(-rows // batch) + 2, optimizer__semantics=semantics)
    assert sampler_padding(case.spec) == n * -(-rows // n) - rows > 0
    assert not predict(case.spec, "tf.towers", "torch.ddp").differ
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)


def test_sampler_order_with_perm_and_dropout_tf_towers_equal_ddp(pool):
    """An explicit shuffle (perm, two epochs) and per-position dropout masks, batch norm synced."""
    base = make(CNN, parallel__devices=3, parallel__shard="strided", data__order="distributed_sampler",
                data__rows=16, data__global_batch=9, steps=5, model__layers__1__semantics="torch")
    case = _with_perm(base, 2, 4)
    assert sampler_padding(case.spec) == 2
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)
    assert_trajectories_close(run_impl(case, "tf.single"), run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sampler_padding_is_detected_against_one_device(pool, n):
    """Padding changes the epoch's last step only: steps before it agree with one device, it does not."""
    rows, batch = _PADDED[n]
    per_epoch = -(-rows // batch)
    case = _sampler_case(SOFTMAX, n, rows, batch, per_epoch, optimizer__semantics="torch")
    assert predict(case.spec, "tf.towers", "tf.single").differ
    assert predict(case.spec, "torch.ddp", "torch.single").differ
    for par, one in (("tf.towers", "tf.single"), ("torch.ddp", "torch.single")):
        result = compare_trajectories(run_impl(case, par), run_impl(case, one), rtol=RTOL, atol=ATOL)
        assert not result.ok and result.mismatch is not None
        # the first difference: the loss of the padded step (1-based step = steps per epoch)
        assert (result.mismatch.key, result.mismatch.step) == ("loss", per_epoch), (par, result.mismatch)
    # a run that stops before the epoch's last step never reads a padded row
    short = case.replace(steps=per_epoch - 1)
    assert sampler_padding(short.spec) == 0 and not predict(short.spec, "tf.towers", "tf.single").differ
    assert_trajectories_close(run_impl(short, "tf.towers"), run_impl(short, "tf.single"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sampler_order_without_padding_equals_one_device(pool, n):
    """N divides D: no padded row; the epoch's smaller last batch splits evenly, so equal weighting is exact."""
    rows, batch = 4 * 3 * n - n, 4 * n  # D = 11 N: a multiple of N, not of B = 4 N
    case = _sampler_case(SOFTMAX, n, rows, batch, -(-rows // batch) + 2, optimizer__semantics="torch")
    assert sampler_padding(case.spec) == 0 and rows % batch
    for a, b in (("tf.towers", "tf.single"), ("torch.ddp", "torch.single"), ("tf.towers", "torch.ddp")):
        assert not predict(case.spec, a, b).differ
    ddp = run_impl(case, "torch.ddp")
    assert_trajectories_close(ddp, run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "tf.single"), rtol=RTOL, atol=ATOL)
    assert_trajectories_close(run_impl(case, "tf.towers"), ddp, rtol=RTOL, atol=ATOL)


def test_sampler_order_default_rows_is_the_strided_split(pool):
    """With data.rows left at steps x B (N | B | D) the sampler order is the split order, strided."""
    sampler = make(SOFTMAX, parallel__devices=3, data__order="distributed_sampler", optimizer__semantics="torch")
    split = make(SOFTMAX, parallel__devices=3, parallel__shard="strided", optimizer__semantics="torch")
    a, b = run_impl(sampler, "torch.ddp"), run_impl(split, "torch.ddp")
    for k in a:
        assert _bits(a[k]) == _bits(b[k]), k


def test_ddp_counts_padded_rows_as_data(pool):
    """D = 10 rows, N = 4, B = 12: one step, rows 0..9 then 0, 1 again; DDP's gradient is that 12-row mean.

    The prediction is built by hand, without the pipeline: a split-order case whose
    one global batch lists the rows with the two repeats, on one process.
    """
    case = _sampler_case(SOFTMAX, 4, 10, 12, 1, optimizer__semantics="torch")
    rows = [*range(10), 0, 1]
    by_hand = dict(SOFTMAX, data={"arrays": True, "global_batch": 12}, init={"arrays": True},
                   steps=1, optimizer=case.spec["optimizer"])
    want = run_impl(case_from_dict(by_hand, x=case.x[rows], y=case.y[rows], init=case.init), "torch.single")
    ddp = run_impl(case, "torch.ddp")
    assert_trajectories_close(ddp, want, rtol=RTOL, atol=ATOL)
    # and one process on the 10 real rows differs, by far more than rounding
    gap = compare_trajectories(ddp, run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)
    assert not gap.ok and gap.max_rel > 1e-3


def test_paths_without_the_sampler_order_refuse_it_as_bad_input(tmp_path, capsys):
    """tf.v1 / tf.mirrored read the split order only: a distributed_sampler case is exit 2, naming data.order."""
    import json

    from parity_tests.cli import main
    from parity_tests.tests.helpers import MLP, set_path

    raw = set_path(set_path(MLP, "data.order", "distributed_sampler"), "parallel", {"devices": 2})
    (tmp_path / "case.json").write_text(json.dumps(raw))
    for impl in ("tf.v1", "tf.mirrored"):
        assert main(["run", str(tmp_path / "case.json"), "--impl", impl, "--out", str(tmp_path / "t.npz")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"tfpar: error: data.order: expected split for {impl} (data.order distributed_sampler runs on tf.towers and tf.single)"]
