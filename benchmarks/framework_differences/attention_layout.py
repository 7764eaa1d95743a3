"""Rows "attention weights" (layout) and "attention scale in float64".

    .venv/bin/python benchmarks/framework_differences/attention_layout.py

Code paths (installed versions):
  Keras 3.15  keras/src/layers/attention/multi_head_attention.py: q, k, v are ``EinsumDense``
              (lines 294, 307, 337) with kernels ``[D, H, key_dim]``, biases ``[H, key_dim]``; the
              output dense (line 352) has kernel ``[H, value_dim, D]``; inputs batch first.
              Scale: ``self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))`` (line 201),
              applied as ``tf.cast(scale, logits.dtype)`` on the default path
              (keras/src/backend/tensorflow/nn.py:1708, via ``ops.dot_product_attention``, line
              556) or ``ops.cast(self._inverse_sqrt_key_dim, query.dtype)`` on the explicit path
              (line 584, taken with dropout or ``return_attention_scores``). ``tf.cast`` of a
              Python float makes a float32 tensor first: in float64 the scale is float32's.
  torch 2.13  torch/nn/modules/activation.py:1207 ``in_proj_weight [3E, E]`` (q, k, v rows
              stacked, ``out x in``), ``in_proj_bias [3E]``, ``out_proj`` (line 1218) ``[E, E]``;
              ``batch_first=False`` (line 1172): inputs ``[T, B, E]``. Scale
              ``math.sqrt(1.0 / float(E))`` in Python double (torch/nn/functional.py:7025, the
              ``need_weights=True`` path) or inside ``scaled_dot_product_attention`` (line 7077).
              ``head_dim = E / H``: torch's class cannot express ``H * key_dim != D``.

Mapping (Keras -> torch): ``in_proj_weight = concat(Wq, Wk, Wv reshaped [D, H*dk]).T``,
``in_proj_bias = concat(bq, bk, bv reshaped [H*dk])``, ``out_proj.weight = Wo.reshape(H*dv, D).T``,
``out_proj.bias = bo``; inputs transposed to ``[T, B, E]`` (or ``batch_first=True``). With it the
two classes agree to rounding in float32; in float64 they differ by the float32-rounded scale
(``key_dim`` 3: ``fl32(1/sqrt 3)`` is off by 1.8e-8 relative; the output gap is about that
times the logits' size) unless
``1/sqrt(key_dim)`` is exact in float32 (key_dim 1, 4, 16, 64, ...: powers of 4;
ViT-B's and GPT-2's key_dim 64 is exact, 32 or 48 are not).
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

B, T, H = 3, 5, 2


def inputs(dk: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((B, T, H * dk)).astype(dtype)


def keras_side(dk: int, dtype: str) -> dict:
    import keras
    from _common import versions_tf

    keras.utils.set_random_seed(0)
    x = inputs(dk, dtype)
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=dk, dtype=dtype)
    fast = np.asarray(layer(x, x))  # ops.dot_product_attention path
    explicit, _ = layer(x, x, return_attention_scores=True)  # explicit einsum + Softmax path
    w = {
        "q.kernel": layer._query_dense.kernel, "q.bias": layer._query_dense.bias,
        "k.kernel": layer._key_dense.kernel, "k.bias": layer._key_dense.bias,
        "v.kernel": layer._value_dense.kernel, "v.bias": layer._value_dense.bias,
        "o.kernel": layer._output_dense.kernel, "o.bias": layer._output_dense.bias,
    }
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    return {"fast": fast, "explicit": np.asarray(explicit), "w": {k: np.asarray(v) for k, v in w.items()},
            "shapes": shapes, **versions_tf()}


def torch_side(dk: int, dtype: str, w: dict, batch_first_mistake: bool = False) -> dict:
    import torch
    from _common import versions_torch

    E = H * dk
    tdt = getattr(torch, dtype)
    mha = torch.nn.MultiheadAttention(E, H, dtype=tdt)  # batch_first=False, the default
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate(
            [w[f"{p}.kernel"].reshape(E, E) for p in "qkv"], axis=1).T))
        mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate([w[f"{p}.bias"].reshape(E) for p in "qkv"])))
        mha.out_proj.weight.copy_(torch.from_numpy(w["o.kernel"].reshape(E, E).T))
        mha.out_proj.bias.copy_(torch.from_numpy(w["o.bias"]))
        x = torch.from_numpy(inputs(dk, dtype))
        xt = x if batch_first_mistake else x.transpose(0, 1)
        y_w, _ = mha(xt, xt, xt, need_weights=True)
        y_sdpa, _ = mha(xt, xt, xt, need_weights=False)
        if not batch_first_mistake:
            y_w, y_sdpa = y_w.transpose(0, 1), y_sdpa.transpose(0, 1)
    return {"need_weights": y_w.numpy(), "sdpa": y_sdpa.numpy(),
            "shapes": {"in_proj_weight": tuple(mha.in_proj_weight.shape),
                       "out_proj.weight": tuple(mha.out_proj.weight.shape)},
            "batch_first": mha.batch_first, **versions_torch()}


def exact(dk: int, w: dict) -> np.ndarray:
    """The attention in float64 numpy with the exact scale, from Keras' own weights."""
    x = inputs(dk, "float64")
    q = np.einsum("btd,dhk->bthk", x, w["q.kernel"]) + w["q.bias"]
    k = np.einsum("btd,dhk->bthk", x, w["k.kernel"]) + w["k.bias"]
    v = np.einsum("btd,dhk->bthk", x, w["v.kernel"]) + w["v.bias"]
    s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(dk)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    c = np.einsum("bhts,bshk->bthk", p, v)
    return np.einsum("bthk,hkd->btd", c, w["o.kernel"]) + w["o.bias"]


def main() -> None:
    rows = {}
    for dtype in ("float32", "float64"):
        for dk in (3, 4):
            k = on_side(keras_side, dk, dtype)
            t = on_side(torch_side, dk, dtype, k["w"])
            gap = max(max_abs(k[a], t[b]) for a in ("fast", "explicit") for b in ("need_weights", "sdpa"))
            line = f"{dtype} key_dim {dk}: mapped Keras vs torch {gap:.2g}"
            if dtype == "float64":
                ex = exact(dk, k["w"])
                line += (f" (Keras vs exact float64 {max_abs(k['fast'], ex):.2g}, "
                         f"torch vs exact {max_abs(t['need_weights'], ex):.2g})")
            print(line)
            rows[(dtype, dk)] = gap
    print(f"Keras shapes {k['shapes']}; torch {t['shapes']}, batch_first={t['batch_first']}")
    k32 = on_side(keras_side, 4, "float32")
    wrong = on_side(torch_side, 4, "float32", k32["w"], True)
    bf = max_abs(k32["fast"], wrong["need_weights"])
    print(f"batch-first input fed to torch's default batch_first=False (runs silently): {bf:.2g}")
    scale32 = float(np.float32(1 / np.sqrt(3.0)))
    print(f"fl32(1/sqrt 3) - 1/sqrt 3 = {scale32 - 1 / np.sqrt(3.0):.3g} (relative "
          f"{(scale32 - 1 / np.sqrt(3.0)) * np.sqrt(3.0):.2g})")
    result(
        "attention weight layout",
        True,
        f"layout only: {rows[('float32', 3)]:.2g} float32, {rows[('float64', 4)]:.2g} float64 key_dim 4 "
        f"after mapping; {bf:.2g} if batch_first is forgotten",
        "H * key_dim = D (torch's class); mapping applied",
        "kernels [D,H,dk]->[3E,E] rows, [H,dv,D]->[E,E].T; inputs [T,B,E] or batch_first=True",
    )
    result(
        "attention scale float64",
        True,
        f"{rows[('float64', 3)]:.2g} (key_dim 3); {rows[('float64', 4)]:.2g} (key_dim 4, exact scale)",
        "float32 compute, or 1/sqrt(key_dim) exact in float32 (key_dim a power of 4)",
        "semantics tf or torch on the layer; framework bug (examples/framework-bugs/keras_attention_scale_float64.py)",
    )


if __name__ == "__main__":
    main()
