"""Trajectory arrays that do not have to fit in memory: rows spilled to a file as they are recorded.

A run records one row per step of every parameter, gradient and state
(``[steps+1, *shape]``). For a 25 M-parameter model that is 100 MB a row in
float32 and 200 MB in float64: 20 steps of parameters and gradients of the four
runs of one float32 case (two implementations, float32 and float64) are ~25 GB,
more than this machine's memory. So every runner collects rows in a
:class:`RowList`: it keeps them in memory while an array is small (the fast
path of every small case) and moves them to a raw file under the spill folder
once they pass :func:`spill_threshold`; :meth:`RowList.finish` then returns a plain
``numpy`` array or a :class:`RowArray`, a read-only array whose rows are read
from the file one at a time. The judge works row by row (``relative_gap``, the
row norms and non-finite rows, which a :class:`RowArray` computed while it was
written), so the memory a comparison needs is a few rows, not a trajectory.

Files live in one folder per top-level process, named in ``TFPAR_SPILL_ROOT``
(by :func:`ensure_spill_root`, which the torch pool and the TensorFlow plugin
server call before they start workers, so that the workers inherit it and spill
into it too; nothing happens at import). A :class:`RowArray` deletes its file when it is garbage-collected; sent
to another process (pickled) it hands the file over to the receiver. The
process that named the folder removes it at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.protocol import settings

__all__ = ["ensure_spill_root", "reporting_progress", "Keeper", "RowArray", "RowList", "RowRef", "RowStore", "remove_files", "array_dtype", "finish", "iter_pairs", "iter_rows", "nbytes",
           "nonfinite_rows", "remove_spill_root", "row_norms", "set_spill_threshold", "spill_arrays", "spill_root", "spill_threshold",
           "to_file"]

# rows read at a time by the chunked readers, bounded in elements: a chunk of a large array is
# one row or a few (32 MB in float64), a small array is one chunk
CHUNK_ELEMENTS = 4 * 2**20
#: the threshold set by :func:`set_spill_threshold` (``None``: ``TFPAR_SPILL_BYTES``, read when first needed)
_threshold: list[int | None] = [None]
#: bytes of rows this process holds in memory in unfinished :class:`RowList` s, all arrays together: the
#: threshold bounds this sum too, so a model of many arrays each under it (a transformer's hundred
#: kernels) spills like one large array instead of keeping its whole trajectory in memory
_held = [0]
_held_lock = threading.Lock()
_PREFIX = "tfpar-spill-"  # the folders the tool names (a user's TFPAR_SPILL_ROOT may be any folder)
#: (pid, folder) of the spill folder this process named, if it named one: only that process removes it
#: (a forked child inherits this list but not the ownership)
_owned: list[tuple[int, str] | None] = [None]


def ensure_spill_root() -> str:
    """Name this process tree's spill folder, if no process above named it (``TFPAR_SPILL_ROOT``).

    Called before a process starts workers (the torch pool, the TensorFlow plugin server), so
    that they inherit the name and spill into the same folder, and on the first spill. The
    process that names the folder owns it: :func:`remove_spill_root` removes it, at exit too.
    """
    root = settings.spill_root()
    if root is None:
        root = os.path.join(tempfile.gettempdir(), f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(root, exist_ok=True)  # now: a worker may spill before this process does
        settings.set_spill_root(root)
        _owned[0] = (os.getpid(), root)
        atexit.register(remove_spill_root)
    return root


def _owns(root: str | None) -> bool:
    """Whether this process named the spill folder ``root`` (a forked child did not, whatever it inherited)."""
    owned = _owned[0]
    return owned is not None and owned[0] == os.getpid() and owned[1] == root


def remove_spill_root() -> None:
    """Remove this process's spill folder and everything in it, if this process named it (at exit;
    the ``tfpar`` command also calls it on its way out, which an interrupted exit may skip)."""
    root = settings.spill_root()
    if _owns(root):
        shutil.rmtree(root, ignore_errors=True)


def spill_root() -> Path:
    """The spill folder (named and created on first use).

    A folder the tool named is created only by the process that named it: a worker that spills
    after that process removed it (a rank still finishing a step while Ctrl-C tears the run down)
    fails to write, rather than bring the folder back for nobody to remove. A folder the user
    named (``TFPAR_SPILL_ROOT``, docs/settings.md) is created by whichever process needs it.
    """
    root = Path(ensure_spill_root())
    if _owns(str(root)) or not root.name.startswith(_PREFIX):
        root.mkdir(parents=True, exist_ok=True)
    elif not root.is_dir():
        raise FileNotFoundError(f"the spill folder {root} is gone: the run that named it has ended")
    return root


#: called after each row a spill writes (``reporting_progress``): a pool rank's beat, so that the minutes a large
#: model's copies take on a loaded machine read as progress, not as a hang (``torchref.pool``)
_progress: list[Callable[[], None] | None] = [None]


@contextlib.contextmanager
def reporting_progress(beat: Callable[[], None] | None) -> Iterator[None]:
    """Within the block, every row written to a spill file calls ``beat()`` (this process only).

    A pool job's parent takes a rank that sends nothing for its timeout for hung; writing
    GPT-2 small's float64 gradients, parameters and captured step (1 GB each) to files on a busy
    machine can take longer than that between two training steps.
    """
    old, _progress[0] = _progress[0], beat
    try:
        yield
    finally:
        _progress[0] = old


def _tick() -> None:
    if (beat := _progress[0]) is not None:
        beat()


def spill_threshold() -> int:
    """Bytes of rows a process may hold in memory, one array's and all unfinished arrays' together,
    before the rows move to files (``TFPAR_SPILL_BYTES`` unless set)."""
    if _threshold[0] is None:
        _threshold[0] = settings.spill_bytes()
    return _threshold[0]


def set_spill_threshold(nbytes: int) -> int:
    """Set :func:`spill_threshold` for this process; returns the previous value (tests, benchmarks)."""
    if not (isinstance(nbytes, int) and nbytes >= 0):
        raise ValueError(f"spill threshold: expected an integer >= 0, got {nbytes!r}")
    old, _threshold[0] = spill_threshold(), nbytes
    return old


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _stats(row: np.ndarray) -> tuple[float, bool]:
    """``(||row||_inf as float64, all finite)``; the norm is NaN where the row holds a NaN (as ``max`` gives).

    From the row's largest and smallest element, not ``abs(row).max()``: the same number (``|x|`` is exact
    and ``max(|hi|, |lo|)`` is the largest ``|x|``), without a temporary copy of the row (a 32 MB
    embedding row of a float64 GPT: 5 ms of CPU for ``abs().max()``, 2 ms this way).
    """
    if row.size == 0:
        return 0.0, True
    with np.errstate(invalid="ignore"):
        hi, lo = float(row.max()), float(row.min())
    if hi != hi or lo != lo:  # a NaN anywhere: max and min propagate it
        return float("nan"), False
    norm = max(abs(hi), abs(lo))
    return norm, bool(np.isfinite(norm))


def _raw(a: Any, dtype: Any = None) -> np.ndarray:
    """``a``'s bytes in C order as a flat ``uint8`` view, what a file write takes: the same bytes as
    ``tobytes()`` without its copy (a copy of every spilled row was a third of the recorder's CPU time
    on a large model); a copy only where ``a`` is not C-contiguous or not of ``dtype``."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1).view(np.uint8)


class _FileArray:
    """What a file-backed array answers without reading its file: from ``shape`` and ``dtype``."""

    shape: tuple[int, ...]
    dtype: np.dtype
    __array_priority__ = 10.0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class RowArray(_FileArray):
    """A read-only ``[rows, *shape]`` array whose rows live in a raw file (C order, native byte order).

    ``a[i]`` (an int) reads one row; ``np.asarray(a)``, slices and fancy indices read the
    whole array (what code that needs it all, a report of a small run, does). ``norms``
    (``[rows]`` float64, ``||a[i]||_inf``) and ``finite`` (``[rows]`` bool) were computed
    as the rows were written, so the judge's row norms and non-finite checks read nothing.
    """

    def __init__(self, path: str, dtype: Any, row_shape: tuple[int, ...], norms: np.ndarray,
                 finite: np.ndarray, *, owner: bool = True) -> None:
        self.path = str(path)
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(int(s) for s in row_shape)
        self.norms = np.asarray(norms, np.float64)
        self.finite = np.asarray(finite, bool)
        self._finalizer = weakref.finalize(self, _unlink, self.path) if owner else None

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return (len(self.norms), *self.row_shape)

    def __len__(self) -> int:
        return len(self.norms)

    def row(self, i: int) -> np.ndarray:
        """Row ``i`` (negative counts from the end) as a new array."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        count = int(np.prod(self.row_shape))
        out = np.fromfile(self.path, dtype=self.dtype, count=count, offset=i * count * self.dtype.itemsize)
        return out.reshape(self.row_shape)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as one new array ``[stop - start, *shape]``."""
        count = int(np.prod(self.row_shape))
        out = np.fromfile(self.path, dtype=self.dtype, count=(stop - start) * count,
                          offset=start * count * self.dtype.itemsize)
        return out.reshape((stop - start, *self.row_shape))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            return self.row(int(index))
        if isinstance(index, slice) and index.step in (None, 1):  # a range of rows: only those are read
            start, stop, _ = index.indices(len(self))
            return self.rows(start, max(start, stop))
        return np.asarray(self)[index]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.rows(0, len(self))
        return out if dtype is None else out.astype(dtype, copy=False)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.row(i) for i in range(len(self)))

    def __repr__(self) -> str:
        return f"RowArray(shape={self.shape}, dtype={self.dtype.name}, path={self.path!r})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # pickled to another process (a pool worker's result): the receiver owns the file now
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return (RowArray, (self.path, self.dtype.str, self.row_shape, self.norms, self.finite))


class RowList:
    """A list of equally shaped rows that moves to a :class:`RowArray` file past :func:`spill_threshold`:
    when its own rows, or the rows of every unfinished list of the process together, pass it.

    ``append`` copies nothing it does not have to: rows given as numpy arrays are kept as
    they are (the runners hand over fresh snapshots) until the list spills.
    """

    def __init__(self, rows: Sequence[Any] = ()) -> None:
        self._rows: list[np.ndarray] = []
        self._file: Any = None
        self._path: str | None = None
        self._norms: list[float] = []
        self._finite: list[bool] = []
        self._dtype: np.dtype | None = None
        self._shape: tuple[int, ...] | None = None
        for r in rows:
            self.append(r)

    def __len__(self) -> int:
        return len(self._norms)

    def append(self, row: Any) -> None:
        row = np.asarray(row)
        if self._dtype is None:
            self._dtype, self._shape = row.dtype, row.shape
        elif row.shape != self._shape:
            raise ValueError(f"row {len(self)} has shape {row.shape}, the rows before {self._shape}")
        norm, ok = _stats(row)
        self._norms.append(norm)
        self._finite.append(ok)
        if self._file is None:
            self._rows.append(row)
            with _held_lock:
                _held[0] += row.nbytes
                held = _held[0]
            # this array's rows past the threshold, or every unfinished array's together
            if len(self._rows) * row.nbytes > spill_threshold() or held > spill_threshold():
                self._spill()
        else:
            self._write(row)

    def _release(self) -> list[np.ndarray]:
        """The rows held in memory, no longer counted in the process's total."""
        rows, self._rows = self._rows, []
        with _held_lock:
            _held[0] -= sum(r.nbytes for r in rows)
        return rows

    def _spill(self) -> None:
        self._path = str(spill_root() / f"{os.getpid()}-{uuid.uuid4().hex}.rows")
        self._file = open(self._path, "wb")  # noqa: SIM115  (kept open while rows arrive; closed in finish)
        for r in self._release():
            self._write(r)

    def _write(self, row: np.ndarray) -> None:
        self._file.write(_raw(row, self._dtype))
        _tick()

    def finish(self) -> np.ndarray | RowArray:
        """All rows: ``np.stack`` of them while in memory, else the :class:`RowArray` of the file."""
        if self._file is None:
            rows = self._release()
            if not rows:
                return np.zeros((0,))
            return np.stack(rows)
        self._file.close()
        self._file = None
        return RowArray(self._path, self._dtype, self._shape, np.asarray(self._norms), np.asarray(self._finite))

    def __del__(self) -> None:  # a run that failed half-way: its rows leave the total, its file goes with it
        with contextlib.suppress(Exception):
            self._release()
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            _unlink(self._path)


class RowRef(_FileArray):
    """One array written at ``offset`` of a :class:`RowStore`'s file: shape and dtype without reading it.

    ``np.asarray(ref)`` reads it. Pickled, it is the file name and offset (what a plugin's rank
    sends the main process); the file is removed by whoever assembles the run (:func:`remove_files`).
    """

    def __init__(self, path: str, offset: int, dtype: Any, shape: tuple[int, ...]) -> None:
        self.path, self.offset = path, int(offset)
        self.dtype, self.shape = np.dtype(dtype), tuple(int(s) for s in shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.fromfile(self.path, dtype=self.dtype, count=self.size, offset=self.offset).reshape(self.shape)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"RowRef(shape={self.shape}, dtype={self.dtype.name})"


class RowStore:
    """Where a plugin's run keeps what it records: in memory up to :func:`spill_threshold`, then in one file.

    ``put(a)`` returns ``a`` while the run's recorded bytes are under the threshold (``threshold``,
    by default :func:`spill_threshold`), else writes it to the run's file and returns a :class:`RowRef`. Unlike a :class:`RowList` it keeps each
    value as the plugin gave it (names, shapes and dtypes are checked afterwards, step by step).
    """

    def __init__(self, threshold: int | None = None) -> None:
        self.kept = 0
        self.path: str | None = None
        self._file: Any = None
        self._offset = 0
        self._threshold = threshold  # None: spill_threshold() at each put

    def put(self, a: np.ndarray) -> np.ndarray | RowRef:
        limit = spill_threshold() if self._threshold is None else self._threshold
        if self.kept + a.nbytes <= limit and self._file is None:
            self.kept += a.nbytes
            return a
        if self._file is None:
            self.path = str(spill_root() / f"{os.getpid()}-{uuid.uuid4().hex}.plugin")
            self._file = open(self.path, "wb")  # noqa: SIM115  (open while the run records; closed in close())
        data = np.ascontiguousarray(a)
        ref = RowRef(self.path, self._offset, data.dtype, data.shape)
        self._file.write(_raw(data))
        self._file.flush()
        self._offset += data.nbytes
        _tick()
        return ref

    def close(self) -> list[str]:
        """Stop writing; the files to remove once the run is assembled."""
        if self._file is not None:
            self._file.close()
            self._file = None
        return [self.path] if self.path else []


def to_file(a: Any) -> RowArray:
    """``a`` (``[rows, ...]``) written to a spill file row by row: its :class:`RowArray` (the same bytes).

    Nothing half-written stays: a write that fails removes the file.
    """
    a = np.asarray(a)
    if a.ndim == 0:
        raise ValueError("a spilled array needs a first axis (rows); got a scalar")
    path = str(spill_root() / f"{os.getpid()}-{uuid.uuid4().hex}.rows")
    norms, finite = np.empty(len(a)), np.empty(len(a), bool)
    try:
        with open(path, "wb") as f:
            for i, row in enumerate(a):
                norms[i], finite[i] = _stats(row)
                f.write(_raw(row))
                _tick()
    except BaseException:
        _unlink(path)
        raise
    return RowArray(path, a.dtype, a.shape[1:], norms, finite)


def spill_arrays(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """``arrays`` with its largest numpy arrays moved to files (:func:`to_file`) until the rest hold at most
    :func:`spill_threshold` bytes; under it, ``arrays`` as they are.

    For what a run records beside its rows in one piece: a captured step's per-device values
    (``device/...``: every device's gradients, the combined gradient, every layer's output) are
    N + 2 copies of the model, which a process would otherwise hold, and pickle, whole.
    """
    sizes = {k: v.nbytes for k, v in arrays.items() if isinstance(v, np.ndarray) and v.ndim >= 1}
    held = sum(sizes.values())
    out = dict(arrays)
    for k in sorted(sizes, key=lambda k: -sizes[k]):  # the largest first: fewest files
        if held <= spill_threshold():
            break
        out[k] = to_file(arrays[k])
        held -= sizes[k]
    return out


class Keeper:
    """Arrays handed over one at a time (a captured step as its engine copies it out of the framework): each kept
    in memory while those kept hold at most :func:`spill_threshold` bytes together, else written to a file
    (:func:`to_file`) at once, so the whole step is never in memory beside the framework's own copy."""

    def __init__(self) -> None:
        self.held = 0

    def __call__(self, a: np.ndarray) -> np.ndarray | RowArray:
        if a.ndim == 0 or self.held + a.nbytes <= spill_threshold():
            self.held += a.nbytes
            return a
        return to_file(a)


def remove_files(paths: Sequence[str]) -> None:
    """Remove spill files (a plugin run's :class:`RowStore` files once assembled)."""
    for p in paths:
        _unlink(p)


def finish(rows: Any) -> np.ndarray | RowArray:
    """``rows.finish()`` for a :class:`RowList`, ``np.stack(rows)`` for a list of arrays."""
    return rows.finish() if isinstance(rows, RowList) else np.stack(rows)


def nbytes(arr: Any) -> int:
    """Bytes of an array or :class:`RowArray` without reading it."""
    return int(arr.nbytes) if hasattr(arr, "nbytes") else int(np.asarray(arr).nbytes)


def iter_rows(arr: Any, max_elements: int = CHUNK_ELEMENTS) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, rows)`` chunks of ``arr`` along its first axis, each at most ``max_elements`` (one row at least).

    A numpy array that fits comes back whole (``start`` 0): small cases pay nothing.
    """
    n = len(arr)
    per_row = max(1, int(np.prod(arr.shape[1:])))
    step = max(1, max_elements // per_row)
    if not isinstance(arr, RowArray):
        arr = np.asarray(arr)
        if step >= n:
            yield 0, arr
            return
    for start in range(0, n, step):
        stop = min(n, start + step)
        yield start, (arr.rows(start, stop) if isinstance(arr, RowArray) else arr[start:stop])


def iter_pairs(a: Any, b: Any, max_elements: int = CHUNK_ELEMENTS) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(start, a_rows, b_rows)``: :func:`iter_rows` of two arrays of one shape, chunk by chunk."""
    if len(a) != len(b):
        raise ValueError(f"row counts differ: {len(a)} and {len(b)}")
    for (start, xa), (_, ya) in zip(iter_rows(a, max_elements), iter_rows(b, max_elements), strict=True):
        yield start, xa, ya


def array_dtype(arr: Any) -> np.dtype:
    """The dtype of an array or :class:`RowArray` (without reading it)."""
    return arr.dtype if isinstance(arr, (np.ndarray, RowArray)) else np.asarray(arr).dtype


def row_norms(arr: Any) -> np.ndarray:
    """``[rows]`` float64 ``||arr[i]||_inf`` (NaN for a row holding a NaN)."""
    if isinstance(arr, RowArray):
        return arr.norms.copy()
    a = np.asarray(arr, dtype=np.float64)
    flat = a.reshape(a.shape[0], -1)
    if flat.shape[1] == 0:
        return np.zeros(a.shape[0])
    with np.errstate(invalid="ignore"):
        return np.abs(flat).max(axis=1)


def nonfinite_rows(arr: Any) -> np.ndarray:
    """``[rows]`` bool: the row holds a NaN or Inf."""
    if isinstance(arr, RowArray):
        return ~arr.finite
    a = np.asarray(arr)
    if a.ndim == 0:
        return np.asarray([not np.isfinite(a)])
    return ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
