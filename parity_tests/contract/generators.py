"""Built-in numpy data generators and initial-weight draws.

Everything here is numpy with an explicit ``np.random.default_rng(seed)``, so
every implementation starts from the same numbers, bit for bit.

Generators (``data.generator``):

``poly``
    The classic tower programs' polynomial regression: ``x ~ U[-10, 10]`` (scalar input),
    ``y = 5 x^2 + 3`` (shape ``[1]``). Use with a ``poly`` layer and ``mse``.
``binary5``
    The classic tower programs' binary task on 5 integer features: ``x`` integers in
    ``[0, 10)``, ``y = 1`` when the features sum to more than 22 (shape ``[1]``).
    Use with ``sigmoid_ce``.
``blobs``
    A small softmax classification task: ``k`` Gaussian blobs (``k`` = the
    model's output width) in ``input_shape[0]`` dimensions; integer labels.
``gaussian``
    Generic: ``x ~ N(0, 1)`` of the input shape; targets drawn to suit the
    loss (``N(0, 1)`` for ``mse``, ``U[0, 1]`` for ``sigmoid_ce``, uniform
    integer labels for ``softmax_ce``).
``digits``
    Real handwritten digits: the 1797 UCI 8x8 digits, a copy of the file
    scikit-learn ships (``data/digits.csv.gz``; nothing is downloaded), enlarged by whole pixel blocks and
    centred in the image ``input_shape`` (``[28, 28, 1]``: MNIST's shape);
    10 classes, for ``softmax_ce``; rows drawn in a seeded order.
``images``
    MNIST-shaped synthetic digits for ``softmax_ce``, of any image
    ``input_shape`` ``[H, W, C]`` (``[28, 28, 1]`` like MNIST, or smaller such
    as ``[8, 8, 1]`` for speed): each of the ``k`` classes has a prototype made
    of a few Gaussian strokes; an example is its class's prototype shifted by
    up to one pixel, scaled in contrast by U[0.8, 1.2], plus N(0, 0.1^2)
    noise, clipped to [0, 1]. Drawn in numpy, any size, no files; ``digits``
    below gives real handwritten digits instead.

``tokens``
    A synthetic next-token task for a token model (first layer ``embedding``, input
    ``[T]``, per-token ``softmax_ce`` over logits ``[T, k]``): each row is a sequence
    ``s_0 .. s_T`` over ``m = min(V, k)`` symbols, ``s_0`` uniform, then
    ``s_{t+1} = (a s_t + c) mod m`` with probability 0.8 (``a``, ``c`` drawn once per
    case) and uniform otherwise; ``x = s_0 .. s_{T-1}`` (int64 ids), ``y = s_1 .. s_T``.

Dropout masks (:func:`dropout_masks`) are drawn here too, from the case's
top-level ``seed``, and handed to both frameworks as data.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from parity_tests.contract.attention import attention_masks
from parity_tests.contract.specs import ParamSpec, nested_inputs
from parity_tests.protocol.errors import CaseError

__all__ = ["GENERATORS", "generate_data", "draw_init", "dropout_masks", "mask_seed", "INIT_KINDS"]

INIT_KINDS = ("normal", "glorot_uniform")
#: the UCI digits of the ``digits`` generator, a copy of scikit-learn's file (``data/README.md``)
DIGITS_FILE = Path(__file__).with_name("data") / "digits.csv.gz"


def _poly(rng, rows, in_shape, out_shape, loss):
    x = rng.uniform(-10.0, 10.0, size=(rows,))
    return x, (5.0 * x**2 + 3.0).reshape(rows, 1)


def _binary5(rng, rows, in_shape, out_shape, loss):
    x = rng.integers(0, 10, size=(rows, 5)).astype(np.float64)
    return x, (x.sum(axis=1) > 22).astype(np.float64).reshape(rows, 1)


def _blobs(rng, rows, in_shape, out_shape, loss):
    k, d = out_shape[-1], in_shape[0]
    centers = rng.normal(0.0, 3.0, size=(k, d))
    y = rng.integers(0, k, size=(rows,))
    x = centers[y] + rng.normal(size=(rows, d))
    return x, y.astype(np.int64)


def _gaussian(rng, rows, in_shape, out_shape, loss):
    x = rng.normal(size=(rows, *in_shape))
    if loss == "softmax_ce":
        y = rng.integers(0, out_shape[-1], size=(rows,)).astype(np.int64)
    elif loss == "sigmoid_ce":
        y = rng.uniform(size=(rows, *out_shape))
    else:
        y = rng.normal(size=(rows, *out_shape))
    return x, y


def digit_images(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The 1797 real handwritten digits (UCI, 8x8, 16 grey levels, as scikit-learn ships them), placed in ``shape``.

    Each 8x8 image is scaled to [0, 1], enlarged by the largest whole factor
    that fits (``np.kron``: pixel blocks, no interpolation) and centred in an
    ``[H, W, C]`` canvas, copied to every channel: ``[28, 28, 1]`` gives
    MNIST's shape (24x24 digits with a 2-pixel border).

    Returns:
        images ``[1797, H, W, C]`` float64 and labels ``[1797]`` int64.
    """
    images, labels = _uci_digits()
    h, w, c = shape
    f = min(h // 8, w // 8)
    small = images / 16.0
    big = np.kron(small, np.ones((f, f)))  # [n, 8f, 8f]
    top, left = (h - 8 * f) // 2, (w - 8 * f) // 2
    out = np.zeros((len(small), h, w, c))
    out[:, top:top + 8 * f, left:left + 8 * f, :] = big[..., None]
    return out, labels


@functools.cache
def _uci_digits() -> tuple[np.ndarray, np.ndarray]:
    """``data/digits.csv.gz`` (``data/README.md``): pixel counts ``[1797, 8, 8]`` float64 (0..16), labels ``[1797]`` int64.

    Read as scikit-learn's ``load_digits`` reads the same file (64 pixels, then the label).
    """
    with gzip.open(DIGITS_FILE, "rt") as f:
        rows = np.loadtxt(f, delimiter=",")
    rows.flags.writeable = False
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


def _digits(rng, rows, in_shape, out_shape, loss):
    if len(in_shape) != 3 or in_shape[0] < 8 or in_shape[1] < 8:
        raise CaseError("model.input_shape", "an image shape [height, width, channels] of at least 8x8 for "
                        "data.generator 'digits'", list(in_shape))
    images, labels = digit_images(tuple(in_shape))
    # every digit once per pass, in a seeded order; more rows than digits take further passes
    order = np.concatenate([rng.permutation(len(labels)) for _ in range(-(-rows // len(labels)))])[:rows]
    return images[order], labels[order]


def _images(rng, rows, in_shape, out_shape, loss):
    if len(in_shape) != 3:
        raise CaseError("model.input_shape", "an image shape [height, width, channels] for data.generator 'images'", list(in_shape))
    h, w, c = in_shape
    k = out_shape[-1]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    protos = np.zeros((k, h, w))
    for j in range(k):  # three strokes per class: Gaussian bumps along short random segments
        for _ in range(3):
            (y0, x0), (y1, x1) = rng.uniform(0.2, 0.8, size=(2, 2)) * [h - 1, w - 1]
            for t in np.linspace(0.0, 1.0, 5):
                cy, cx = y0 + t * (y1 - y0), x0 + t * (x1 - x0)
                protos[j] += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * max(h, w) / 14.0))
        protos[j] /= protos[j].max()
    y = rng.integers(0, k, size=(rows,))
    shifts = rng.integers(-1, 2, size=(rows, 2))
    contrast = rng.uniform(0.8, 1.2, size=(rows, 1, 1, 1))
    channel = rng.uniform(0.5, 1.0, size=(1, 1, 1, c))
    x = np.stack([np.roll(protos[y[i]], tuple(shifts[i]), axis=(0, 1)) for i in range(rows)])[..., None]
    x = np.clip(x * contrast * channel + rng.normal(0.0, 0.1, size=(rows, h, w, c)), 0.0, 1.0)
    return x, y.astype(np.int64)


def _tokens(rng, rows, in_shape, out_shape, loss, vocab: int):
    (t,), k = in_shape, out_shape[-1]
    m = min(vocab, k)
    a, c = int(rng.integers(1, max(m, 2))), int(rng.integers(0, m))
    seq = np.empty((rows, t + 1), np.int64)
    seq[:, 0] = rng.integers(0, m, size=rows)
    follow = rng.random((rows, t)) < 0.8
    noise = rng.integers(0, m, size=(rows, t))
    for j in range(t):
        seq[:, j + 1] = np.where(follow[:, j], (a * seq[:, j] + c) % m, noise[:, j])
    return seq[:, :-1], seq[:, 1:]


# name -> (function, required input shape or None, required output shape or None, losses allowed)
GENERATORS: dict[str, tuple[Callable, tuple | None, tuple | None, tuple[str, ...]]] = {
    "poly": (_poly, (), (1,), ("mse",)),
    "binary5": (_binary5, (5,), (1,), ("sigmoid_ce", "mse")),
    "blobs": (_blobs, None, None, ("softmax_ce",)),
    "gaussian": (_gaussian, None, None, ("mse", "sigmoid_ce", "softmax_ce")),
    "images": (_images, None, None, ("softmax_ce",)),
    "digits": (lambda *a: _digits(*a), None, (10,), ("softmax_ce",)),
    "tokens": (_tokens, None, None, ("softmax_ce",)),
}


def generate_data(
    name: str, seed: int, rows: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...], loss: str,
    vocab: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``rows`` examples from a built-in generator (validated beforehand).

    ``vocab``: the embedding's ``input_dim``, for ``tokens``.

    Returns:
        ``x`` float64 ``[rows, *in_shape]`` (int64 token ids for ``tokens``) and ``y``: float64
        ``[rows, *out_shape]``, or int64 ``[rows, *out_shape[:-1]]`` for ``softmax_ce``.
    """
    fn = GENERATORS[name][0]
    if name == "tokens":
        return fn(np.random.default_rng(seed), rows, in_shape, out_shape, loss, vocab)
    x, y = fn(np.random.default_rng(seed), rows, in_shape, out_shape, loss)
    return np.asarray(x, np.float64), y


def draw_init(specs: list[ParamSpec], seed: int, kind: str, stddev: float) -> dict[str, np.ndarray]:
    """Initial values for every parameter, drawn in ``specs`` order from one generator.

    ``normal``: every trainable parameter ~ N(0, stddev^2) (biases too, as the
    classic tower programs' ``tf.random_normal`` initialisation does). ``glorot_uniform``:
    kernels ~ U[-l, l] with ``l = sqrt(6 / (fan_in + fan_out))``, biases zero
    (Keras' defaults). Batch-norm state starts at mean 0, variance 1;
    ``gamma`` (batch and layer norm) and ``scale`` (rms norm) at 1 and ``beta`` at 0 in both kinds.
    Position embeddings ``[T, D]`` and the class token ``[1, D]`` are drawn as dense kernels
    of that shape (normal, or glorot with fan-in and fan-out ``T``/``1`` and ``D``); attention
    kernels as dense layers ``[D, H*key_dim]`` and ``[H*value_dim, D]`` (``ParamSpec.fans``).
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for s in specs:
        if s.kind in ("gamma", "scale", "moving_variance"):
            out[s.name] = np.ones(s.shape)
        elif s.kind in ("beta", "moving_mean"):
            out[s.name] = np.zeros(s.shape)
        elif kind == "normal":
            out[s.name] = rng.normal(0.0, stddev, size=s.shape)
        elif s.kind == "bias":
            out[s.name] = np.zeros(s.shape)
        else:
            fan_in = int(np.prod(s.shape[:-1]))
            fan_out = s.shape[-1]
            if s.fans is not None:  # attention kernels: as the dense layers they are (specs.ParamSpec.fans)
                fan_in, fan_out = s.fans
            elif len(s.shape) > 2:  # conv kernels [kh, kw, in, out], as Keras counts fans
                receptive = int(np.prod(s.shape[:-2]))
                fan_in, fan_out = receptive * s.shape[-2], receptive * s.shape[-1]
            lim = np.sqrt(6.0 / (fan_in + fan_out))
            out[s.name] = rng.uniform(-lim, lim, size=s.shape)
    return out


def mask_seed(seed: int, path: str) -> list[int]:
    """The entropy of dropout layer ``path``'s masks: ``[seed, i]`` for top-level layer ``i``;
    ``[seed, i, hi, lo]`` for a nested one (``3.body.1``, ``5.2.0``), ``hi, lo`` the first 8 bytes
    of ``sha256(path)`` as two 32-bit words, so every path draws its own masks."""
    top, _, rest = path.partition(".")
    if not rest:
        return [seed, int(top)]
    word = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return [seed, int(top), word >> 32, word & 0xFFFFFFFF]


def dropout_masks(spec: dict) -> dict[str, np.ndarray]:
    """Keep-masks of every dropout layer, for every data row, drawn once in numpy.

    Layer ``path``'s mask comes from ``np.random.default_rng(mask_seed(seed, path))`` (``seed``:
    the case's top-level field; :func:`mask_seed`): ``keep = U[0, 1) >= rate``, the comparison
    ``tf.nn.dropout`` makes. Row ``j`` belongs to data row ``j``, so a device
    gets the mask rows of the data rows it gets, whatever the sharding. Dropout inside a
    ``residual`` or ``repeat`` body is keyed by its path (``3.body.1``; each repetition its own).

    Attention layers with ``dropout > 0`` get theirs too, keyed by their path, ``[rows, H, T, T]``
    (:func:`parity_tests.contract.attention.attention_masks`).

    Returns:
        layer path -> bool ``[steps * global_batch, *layer_input_shape]``.
    """
    model = spec["model"]
    rows = spec["steps"] * spec["data"]["global_batch"]
    out = {}
    for path, layer, shape in nested_inputs(model["input_shape"], model["layers"]):
        if layer["type"] == "dropout":
            rng = np.random.default_rng(mask_seed(spec.get("seed", 0), path))
            out[path] = rng.random(size=(rows, *shape)) >= layer["rate"]
    out.update(attention_masks(spec))
    return out
