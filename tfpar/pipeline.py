"""The classic tower programs' input pipeline: TFRecord files, ``tf.data``, and torch's ``DistributedSampler`` order.

A case's rows are written as a TFRecord file (one ``tf.train.Example`` per
row, :func:`write_tfrecord`) and read back with ``tf.data.TFRecordDataset`` and
``tf.io.parse_single_example`` (:func:`read_tfrecord`). From the parsed rows:

``split`` order (:func:`split_batches`)
    ``repeat().batch(B)``: step k reads rows ``[k B, (k+1) B)``, and the towers
    split that global batch (``parallel.shard``). This is the classic tower programs' pipeline
    without its shuffle; :func:`seed_pipeline` is the classic tower programs' pipeline with it
    (``shuffle(buffer, seed).repeat().batch(B)``), whose order is TensorFlow's
    own and cannot be reproduced by torch.
``distributed_sampler`` order (:func:`sampler_batches`)
    what N ranks each running ``DataLoader(ds, batch_size=B/N,
    sampler=DistributedSampler(ds, N, r, shuffle=False, drop_last=False))``
    read together: the epoch's index list (``range(D)``, or a given
    permutation) is padded to ``T = N ceil(D/N)`` entries by repeating its first
    ones, rank r takes entries ``r, r+N, r+2N, ...`` and batches them by
    ``B/N``, the last batch of an epoch being smaller. Step k's global batch is
    the ranks' k-th batches interleaved (row m comes from rank ``m mod N``), so a
    strided split hands every tower exactly its rank's batch. In positions of
    the padded list, batch i of an epoch is ``[i B, min((i+1) B, T))``.

:func:`sampler_indices` is the same order in numpy, :func:`step_rows` the rows of
one step (padded for N ranks, or a single process's unpadded batch).

.. warning:: ``DistributedSampler(shuffle=True)`` draws ``torch.randperm(D,
   generator=g)`` with ``g.manual_seed(seed + epoch)``: torch's generator, which
   no TensorFlow or numpy op reproduces. A shuffled order is therefore given as
   an explicit permutation per epoch (``perms``, ``[E, D]``; epoch e uses
   ``perms[e mod E]``), drawn in numpy, and both sides follow it. A seeded
   ``tf.data`` shuffle likewise has no torch counterpart.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from . import tokens

__all__ = [
    "Field",
    "write_tfrecord",
    "read_tfrecord",
    "seed_pipeline",
    "split_batches",
    "sampler_indices",
    "sampler_dataset",
    "sampler_batches",
    "loader_batches",
    "epoch_steps",
    "step_rows",
    "case_batches",
]


@dataclass(frozen=True)
class Field:
    """How one array is stored per row: its numpy dtype name and the row's shape."""

    dtype: str
    shape: tuple[int, ...]


def _feature(row: np.ndarray, dtype: str) -> tf.train.Feature:
    flat = row.reshape(-1)
    if dtype == "float32":
        return tf.train.Feature(float_list=tf.train.FloatList(value=flat))
    if dtype == "float64":
        # FloatList holds float32 only (a float64 value would be rounded: 1/3 by 3e-8
        # relative, 1e-300 to 0); the row's little-endian bytes keep every bit
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[flat.astype("<f8").tobytes()]))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=flat))


def write_tfrecord(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> dict[str, Field]:
    """Write ``arrays`` as a TFRecord file, one ``tf.train.Example`` per row.

    Args:
        path: the file to write.
        arrays: name -> ``[rows, *shape]``, the same ``rows`` for all; dtypes
            float32 (stored as a ``FloatList``), float64 (the row's raw
            little-endian bytes in a ``BytesList``) or an integer/bool type
            (stored as an ``Int64List``, read back as int64).
    Returns:
        name -> :class:`Field`, what :func:`read_tfrecord` needs to parse the file.
    """
    fields: dict[str, Field] = {}
    data: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.ndim < 1:
            raise ValueError(f"array {name!r} needs a leading row axis, got shape {a.shape}")
        if a.dtype.kind == "f" and a.dtype.itemsize in (4, 8):
            dtype = a.dtype.name
        elif a.dtype.kind in "iub":
            dtype, a = "int64", a.astype(np.int64)
        else:
            raise ValueError(f"array {name!r}: float32, float64 or integers, got {a.dtype}")
        fields[name], data[name] = Field(dtype, tuple(a.shape[1:])), a
    rows = {len(a) for a in data.values()}
    if len(rows) != 1:
        raise ValueError(f"all arrays need the same number of rows, got {sorted(rows)}")
    with tf.io.TFRecordWriter(os.fspath(path)) as w:
        for i in range(rows.pop()):
            feats = {k: _feature(a[i], fields[k].dtype) for k, a in data.items()}
            w.write(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())
    return fields


def read_tfrecord(path: str | os.PathLike, fields: Mapping[str, Field]) -> tf.data.Dataset:
    """The rows of a file written by :func:`write_tfrecord`, in file order.

    Returns:
        a dataset of dicts name -> tensor of the row's shape (``[]`` for a
        scalar row), dtypes float32, float64 or int64.
    """
    spec: dict[str, tf.io.FixedLenFeature] = {}
    for k, f in fields.items():
        if f.dtype == "float64":
            spec[k] = tf.io.FixedLenFeature([], tf.string)
        else:
            spec[k] = tf.io.FixedLenFeature([math.prod(f.shape)], tf.float32 if f.dtype == "float32" else tf.int64)

    def parse(record: tf.Tensor) -> dict[str, tf.Tensor]:
        ex = tf.io.parse_single_example(record, spec)
        out = {}
        for k, f in fields.items():
            v = tf.io.decode_raw(ex[k], tf.float64, little_endian=True) if f.dtype == "float64" else ex[k]
            out[k] = tf.reshape(v, f.shape)
        return out

    return tf.data.TFRecordDataset(os.fspath(path)).map(parse)


def seed_pipeline(ds: tf.data.Dataset, global_batch: int, *, shuffle_buffer: int | None = None,
                  seed: int | None = None) -> tf.data.Dataset:
    """The classic tower programs' pipeline: ``shuffle(buffer, seed=seed).repeat().batch(global_batch)``.

    With ``reshuffle_each_iteration`` (TF's default) every epoch has its own
    order, determined by ``seed``; batches straddle epoch boundaries (``repeat``
    comes before ``batch``). Without ``shuffle_buffer``: :func:`split_batches`.

    .. warning:: the order is TensorFlow's shuffle-buffer draw: no torch
       sampler produces it.
    """
    if shuffle_buffer is not None:
        if seed is None:
            raise ValueError("a shuffle needs a seed for a replayable order")
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    return ds.repeat().batch(global_batch)


def split_batches(ds: tf.data.Dataset, global_batch: int) -> tf.data.Dataset:
    """``repeat().batch(B)``: global batch k is rows ``[k B, (k+1) B)`` (wrapping at the end)."""
    return seed_pipeline(ds, global_batch)


def _padded_total(length: int, num_replicas: int) -> int:
    if length < 1 or num_replicas < 1:
        raise ValueError(f"need a dataset of >= 1 rows and >= 1 replicas, got {length} and {num_replicas}")
    return num_replicas * -(-length // num_replicas)


def sampler_indices(length: int, num_replicas: int, rank: int, order: np.ndarray | None = None) -> np.ndarray:
    """``DistributedSampler(shuffle=False, drop_last=False)``'s indices for ``rank``, in numpy.

    ``order`` (``[length]``) replaces ``range(length)`` as the epoch's index
    list (a shuffled epoch given explicitly). Padding repeats the list's first
    entries (``indices += indices[:T - D]``, cyclically when ``T - D > D``), so
    padded position p holds ``order[p mod D]``.

    Returns:
        int64 ``[ceil(D / N)]``: ``padded[rank : T : N]``.
    """
    total = _padded_total(length, num_replicas)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    idx = np.arange(length, dtype=np.int64) if order is None else np.asarray(order, np.int64)
    if idx.shape != (length,):
        raise ValueError(f"order must have shape [{length}], got {list(idx.shape)}")
    return idx[np.arange(total) % length][rank:total:num_replicas]


def sampler_dataset(ds: tf.data.Dataset, length: int, num_replicas: int, rank: int) -> tf.data.Dataset:
    """One epoch of rank ``rank``'s rows in ``DistributedSampler`` order, in ``tf.data`` ops.

    ``ds.repeat().take(T)`` is the padded list (position p is row ``p mod D``)
    and ``shard(N, rank)`` takes its entries ``rank, rank+N, ...``: the
    sampler's ``indices[rank:T:N]``. ``ds`` must hold exactly ``length`` rows.
    """
    return ds.repeat().take(_padded_total(length, num_replicas)).shard(num_replicas, rank)


def _interleave(parts: tuple[Mapping[str, tf.Tensor], ...]) -> dict[str, tf.Tensor]:
    """Rank batches ``[b, ...]`` -> one global batch ``[N b, ...]`` whose row m is rank (m mod N)'s row m // N."""
    out = {}
    for k in parts[0]:
        stacked = tf.stack([p[k] for p in parts], axis=1)  # [b, N, ...]
        out[k] = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], axis=0))
    return out


def _gathered(ds: tf.data.Dataset, length: int, index_batches: tf.data.Dataset) -> tf.data.Dataset:
    """Batches of rows of ``ds`` picked by a dataset of index vectors (rows read once, kept in memory)."""
    rows = ds.take(length).batch(length).get_single_element()
    return index_batches.map(lambda i: {k: tf.gather(v, i) for k, v in rows.items()})


def sampler_batches(ds: tf.data.Dataset, *, length: int, num_replicas: int, per_rank_batch: int,
                    perms: np.ndarray | None = None) -> tf.data.Dataset:
    """Global batches in ``DistributedSampler`` order, epoch after epoch (an endless dataset).

    Each rank's stream is its sampler epoch batched by ``per_rank_batch`` (the
    last batch of an epoch is smaller, as ``DataLoader(drop_last=False)``
    gives it), repeated; the ranks' k-th batches are interleaved into global
    batch k (:func:`_interleave`), ready for a ``strided`` split.

    Args:
        ds: the dataset's rows (exactly ``length`` of them, dicts of tensors).
        perms: int ``[E, length]``, the index list of epoch e is ``perms[e mod E]``
            (rows gathered from memory); ``None``: ``range(length)`` every epoch
            (pure ``tf.data``: :func:`sampler_dataset`).
    Returns:
        a dataset of dicts ``[N b_k, ...]``.
    """
    ranks = []
    for r in range(num_replicas):
        if perms is None:
            ranks.append(sampler_dataset(ds, length, num_replicas, r).batch(per_rank_batch).repeat())
            continue
        epochs = None
        for order in np.asarray(perms, np.int64).reshape(-1, length):
            e = tf.data.Dataset.from_tensor_slices(sampler_indices(length, num_replicas, r, order)).batch(per_rank_batch)
            epochs = e if epochs is None else epochs.concatenate(e)
        ranks.append(_gathered(ds, length, epochs.repeat()))
    return tf.data.Dataset.zip(tuple(ranks)).map(lambda *parts: _interleave(parts))


def loader_batches(ds: tf.data.Dataset, *, length: int, global_batch: int,
                   perms: np.ndarray | None = None) -> tf.data.Dataset:
    """One process's batches of ``global_batch`` rows per epoch, no padding (an endless dataset).

    What ``DataLoader(ds, batch_size=B, shuffle=False)`` yields in one process:
    epoch after epoch, ``ceil(D / B)`` batches, the last one smaller, in the
    order ``range(D)`` or ``perms[e mod E]``.
    """
    if perms is None:
        return ds.take(length).batch(global_batch).repeat()
    epochs = None
    for order in np.asarray(perms, np.int64).reshape(-1, length):
        e = tf.data.Dataset.from_tensor_slices(order).batch(global_batch)
        epochs = e if epochs is None else epochs.concatenate(e)
    return _gathered(ds, length, epochs.repeat())


def epoch_steps(length: int, global_batch: int) -> int:
    """Steps per epoch: ``ceil(D / B)`` (with N ranks, ``ceil(ceil(D / N) / (B / N))``, the same number)."""
    return -(-length // global_batch)


def step_rows(length: int, global_batch: int, step: int, *, num_replicas: int | None = None,
              perms: np.ndarray | None = None) -> np.ndarray:
    """Data rows of global batch ``step`` (0-based) in ``DistributedSampler`` order, in numpy.

    Step k is batch ``i = k mod S`` of epoch ``e = k // S`` (``S`` =
    :func:`epoch_steps`): positions ``[i B, min((i+1) B, T))`` of the epoch's
    padded list, position p holding row ``order[p mod D]``. With
    ``num_replicas=None`` (one process) ``T = D``: no padding.

    Returns:
        int64 ``[b_k]``, the rows in global-batch order (row m is read by rank m mod N).
    """
    total = length if num_replicas is None else _padded_total(length, num_replicas)
    per_epoch = epoch_steps(length, global_batch)
    epoch, i = divmod(step, per_epoch)
    order = np.arange(length, dtype=np.int64)
    if perms is not None:
        p = np.asarray(perms, np.int64).reshape(-1, length)
        order = p[epoch % len(p)]
    pos = np.arange(i * global_batch, min((i + 1) * global_batch, total))
    return order[pos % length]


@contextlib.contextmanager
def case_batches(payload: Mapping[str, Any], *, towers: int | None,
                 feed: str = "arrays") -> Iterator[Callable[[int], tuple[np.ndarray, np.ndarray, dict]]]:
    """``batches(k) -> (x, y, extras)``: step k's global batch of a validated case.

    Args:
        payload: the case payload (``spec``, ``x``, ``y``, ``masks``, ``perm``).
        towers: N for a parallel run; ``None`` for one device (no padding in
            the ``distributed_sampler`` order).
        feed: ``arrays`` (rows picked from the numpy arrays: :func:`step_rows`)
            or ``tfrecord`` (the rows written to a TFRecord file in a private
            temporary folder and read through ``tf.data``: :func:`split_batches`,
            :func:`sampler_batches` or :func:`loader_batches`). Both give the
            same arrays, bit for bit.
    Yields:
        the function; steps must be asked for in order 0, 1, 2, ... with ``tfrecord``.
        ``x`` ``[b_k, *input_shape]`` in the case dtype, ``y`` ``[b_k, ...]``
        (int64 labels for ``softmax_ce``), ``extras``: the dropout keep-masks
        for the step's positions (mask row ``k B + m`` belongs to row m of step k),
        and ``"w"``, the sample weights of those positions, when the case has them.
    """
    spec = payload["spec"]
    data = spec["data"]
    batch, order = data["global_batch"], data.get("order", "split")
    np_dtype = np.float64 if spec["dtype"] == "float64" else np.float32
    x = tokens.inputs(payload["x"], np_dtype)  # token ids stay int64
    y = payload["y"]
    y = np.asarray(y, np.int64) if spec["model"]["loss"] == "softmax_ce" else np.asarray(y, np_dtype)
    masks = payload.get("masks") or {}
    perms = payload.get("perm")
    length = len(x)
    n = towers if order == "distributed_sampler" else None

    weights = payload.get("w")  # per-example sample weights ride along like the masks, by position

    def extras(k: int, size: int) -> dict[str, np.ndarray]:
        out = {i: m[k * batch:k * batch + size] for i, m in masks.items()}
        if weights is not None:
            out["w"] = np.asarray(weights[k * batch:k * batch + size], np_dtype)
        return out

    if feed == "arrays":
        def from_arrays(k: int):
            rows = (np.arange(k * batch, (k + 1) * batch) if order == "split"
                    else step_rows(length, batch, k, num_replicas=n, perms=perms))
            return x[rows], y[rows], extras(k, len(rows))

        yield from_arrays
        return
    if feed != "tfrecord":
        raise ValueError(f"feed must be arrays or tfrecord, got {feed!r}")
    with tempfile.TemporaryDirectory(prefix="tfpar-data-") as tmp:
        path = os.path.join(tmp, "data.tfrecord")
        ds = read_tfrecord(path, write_tfrecord(path, {"x": x, "y": y}))
        if order == "split":
            stream = split_batches(ds, batch)
        elif n is None:
            stream = loader_batches(ds, length=length, global_batch=batch, perms=perms)
        else:
            stream = sampler_batches(ds, length=length, num_replicas=n, per_rank_batch=batch // n, perms=perms)
        it = iter(stream)
        done = [0]

        def from_tfrecord(k: int):
            if k != done[0]:
                raise ValueError(f"the tfrecord feed reads steps in order: asked for step {k}, next is {done[0]}")
            done[0] += 1
            b = next(it)
            return b["x"].numpy(), b["y"].numpy(), extras(k, int(b["x"].shape[0]))

        yield from_tfrecord
