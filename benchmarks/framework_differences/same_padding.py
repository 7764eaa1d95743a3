"""Rows "stride-2 SAME conv / pool" and "average pooling, SAME".

    .venv/bin/python benchmarks/framework_differences/same_padding.py

Code paths (installed versions):
  Keras 3.15  ``Conv2D(padding="same")`` -> keras/src/backend/tensorflow/nn.py:802 ``conv`` ->
              ``tf.nn.convolution(..., "SAME")``; ``MaxPooling2D`` / ``AveragePooling2D`` ->
              nn.py:234 / 262 -> ``tf.nn.max_pool`` / ``tf.nn.avg_pool`` with ``"SAME"``.
              TensorFlow's SAME: output ``ceil(n / s)``, total padding
              ``p = max((out - 1) s + k - n, 0)``, ``floor(p / 2)`` before and the rest after
              (Keras' own emulation says so: nn.py:869-884, "extra padding goes after").
              Padded positions are ignored by max and **not counted** by the average.
  torch 2.13  ResNet code (torchvision) uses ``nn.Conv2d(k=3, stride=2, padding=1)``,
              ``nn.Conv2d(k=7, stride=2, padding=3)``, ``nn.MaxPool2d(3, 2, padding=1)``:
              symmetric padding. ``nn.AvgPool2d`` has ``count_include_pad=True`` by default
              (torch/nn/modules/pooling.py:766): zeros of the padding are counted.

Conditions and sizes:
  * SAME vs symmetric ``padding=(k-1)/2``: equal when ``p`` is even, i.e. ``p = 2 * padding``
    (n odd for k = 3, s = 2; always at s = 1 with odd k). When ``p`` is odd the windows of torch
    sit one row/column up-left of TensorFlow's: an O(1) difference (no closed form: it is a
    shift of the sampling grid). Mapping: explicit padding ``[[floor(p/2), p - floor(p/2)], ...]``
    on the torch side (``F.pad`` then a 'valid' conv; ``-inf`` padding for max pooling) or
    ``[[1, 1], [1, 1]]`` on the TensorFlow side (``ZeroPadding2D`` then 'valid').
  * Average pooling: at an output whose window holds ``n_valid`` of the ``k*k`` cells,
    ``y_torch = y_tf * n_valid / (k*k)`` exactly, so the gap is ``|y_tf| (1 - n_valid / k^2)``
    (5/9 of the value at a 3x3 corner). Vanishes when no window touches padding ('valid', or
    SAME with p = 0) or with ``count_include_pad=False``. Mapping: ``avg_pool2d.count_padding``.
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

CASES = {  # name: (n, kernel, stride)
    "conv 3x3 s2, n=8 (p=1)": (8, 3, 2),
    "conv 3x3 s2, n=7 (p=2)": (7, 3, 2),
    "conv 7x7 s2, n=32 (p=5, stem)": (32, 7, 2),
}
POOL = {"max 3x3 s2, n=8 (p=1)": (8, 3, 2), "max 3x3 s2, n=7 (p=2)": (7, 3, 2)}
AVG = (6, 3, 1)  # n, k, s: p = 2, symmetric, so only the counting differs


def image(n: int, c: int = 3) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((2, n, n, c)).astype(np.float32)


def kernel(k: int) -> np.ndarray:
    return (np.random.default_rng(k).standard_normal((k, k, 3, 4)) / np.sqrt(k * k * 3)).astype(np.float32)


def keras_side() -> dict:
    import keras
    from _common import versions_tf

    out = {}
    for name, (n, k, s) in CASES.items():
        layer = keras.layers.Conv2D(4, k, strides=s, padding="same", use_bias=False)
        layer.build((None, n, n, 3))
        layer.kernel.assign(kernel(k))
        out[name] = np.asarray(layer(image(n)))
    for name, (n, k, s) in POOL.items():
        out[name] = np.asarray(keras.layers.MaxPooling2D(k, s, padding="same")(image(n)))
    n, k, s = AVG
    out["avg"] = np.asarray(keras.layers.AveragePooling2D(k, s, padding="same")(image(n)))
    return {"out": out, **versions_tf()}


def torch_side() -> dict:
    import torch
    import torch.nn.functional as F
    from _common import versions_torch

    def nchw(a):
        return torch.from_numpy(a).permute(0, 3, 1, 2)

    def nhwc(t):
        return t.permute(0, 2, 3, 1).detach().numpy()

    out, mapped = {}, {}
    for name, (n, k, s) in CASES.items():
        conv = torch.nn.Conv2d(3, 4, k, stride=s, padding=(k - 1) // 2, bias=False)  # ResNet's
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(kernel(k)).permute(3, 2, 0, 1))
            out[name] = nhwc(conv(nchw(image(n))))
            total = max((-(-n // s) - 1) * s + k - n, 0)
            pads = (total // 2, total - total // 2)
            x = F.pad(nchw(image(n)), (pads[0], pads[1], pads[0], pads[1]))
            mapped[name] = nhwc(F.conv2d(x, conv.weight, stride=s))
    for name, (n, k, s) in POOL.items():
        out[name] = nhwc(torch.nn.MaxPool2d(k, s, padding=(k - 1) // 2)(nchw(image(n))))
        total = max((-(-n // s) - 1) * s + k - n, 0)
        x = F.pad(nchw(image(n)), (total // 2, total - total // 2) * 2, value=float("-inf"))
        mapped[name] = nhwc(F.max_pool2d(x, k, s))
    n, k, s = AVG
    out["avg"] = nhwc(torch.nn.AvgPool2d(k, s, padding=1)(nchw(image(n))))
    mapped["avg"] = nhwc(torch.nn.AvgPool2d(k, s, padding=1, count_include_pad=False)(nchw(image(n))))
    return {"out": out, "mapped": mapped, **versions_torch()}


def main() -> None:
    k = on_side(keras_side)
    t = on_side(torch_side)
    print(f"keras {k['keras']}, torch {t['torch']}; inputs N(0, 1), kernels N(0, 1/fan_in)")
    gaps = {}
    for name in [*CASES, *POOL]:
        gaps[name] = max_abs(k["out"][name], t["out"][name])
        print(f"{name:32s} SAME vs symmetric padding: {gaps[name]:.3g}; "
              f"torch with TensorFlow's padding: {max_abs(k['out'][name], t['mapped'][name]):.2g}")
    n, kk, s = AVG
    avg = max_abs(k["out"]["avg"], t["out"]["avg"])
    counts = np.full((n, n), 9.0)
    counts[[0, -1], :] = 6
    counts[:, [0, -1]] = 6
    counts[[0, 0, -1, -1], [0, -1, 0, -1]] = 4
    pred = max_abs(t["out"]["avg"], k["out"]["avg"] * (counts / 9.0)[None, :, :, None])
    print(f"avg 3x3 s1 SAME, n={n}: count_include_pad=True vs TensorFlow {avg:.3g}; "
          f"y_torch = y_tf n_valid/9 holds to {pred:.2g}; count_include_pad=False: "
          f"{max_abs(k['out']['avg'], t['mapped']['avg']):.2g}")
    conv_name = "conv 3x3 s2, n=8 (p=1)"
    pool_name = "max 3x3 s2, n=8 (p=1)"
    result(
        "stride-2 SAME conv / pool",
        True,
        f"{gaps[conv_name]:.2g} conv, {gaps[pool_name]:.2g} max pool (p odd); "
        f"{gaps['conv 3x3 s2, n=7 (p=2)']:.2g} when p is even",
        "total SAME padding p even (= 2 x torch's padding)",
        "explicit padding [[floor(p/2), ceil(p/2)], ...] (torch: F.pad, -inf for max pool)",
    )
    result(
        "avg pool SAME count_include_pad",
        True,
        f"{avg:.2g} (= |y_tf| (1 - n_valid/k^2), 5/9 of the value at a corner)",
        "no window touches padding, or count_include_pad=False",
        "avg_pool2d.count_padding (torch count_include_pad=False for TensorFlow's)",
    )


if __name__ == "__main__":
    main()
