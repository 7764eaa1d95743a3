"""Row "attention masks": the mask's sense, and a fully masked query row.

    .venv/bin/python benchmarks/framework_differences/attention_mask.py

Code paths (installed versions):
  Keras 3.15  ``MultiHeadAttention(attention_mask=...)``: ``True`` (or 1) attends.
              Default path (no dropout, no scores returned): ``ops.dot_product_attention``
              (keras/src/layers/attention/multi_head_attention.py:556) ->
              keras/src/backend/tensorflow/nn.py:1683 ``_apply_masks``: masked logits become
              ``-0.7 * 3.38953e38`` (line 1676), so a fully masked row's softmax is **uniform**
              over all keys (the output is the mean of the values, projected).
              Explicit path (``return_attention_scores=True`` or dropout > 0; line 584 on):
              keras/src/layers/activations/softmax.py:81 puts -1e9 in masked places, and line
              105 zeroes masked weights afterwards: a fully masked row's weights are **zeros**
              (the output is the output bias). So Keras' own two paths differ on such a row.
  torch 2.13  ``nn.MultiheadAttention(attn_mask=...)``: a bool ``True`` **blocks**
              (torch/nn/functional.py:6608 turns it into ``-inf``); a fully masked row's
              softmax over ``-inf`` is NaN on the ``need_weights=True`` path (line 7038);
              the ``need_weights=False`` path goes to ``scaled_dot_product_attention`` (line 7077).

Causal (GPT): Keras' ``use_causal_mask=True`` (a lower-triangular band, nn.py:1691-1695 or
``_compute_causal_mask``) and torch's bool ``triu(1)`` mask (``True`` blocks the future) agree to
rounding; no row of a causal mask is fully masked (the diagonal attends).

The mapping: invert the mask (``torch_mask = ~keras_mask``, repeated per head). With it, rows with
at least one attended key agree to rounding; a fully masked row has no mapping (zeros, uniform
or NaN, by path) and issue 27 refuses it with one line. Condition for no difference: no fully
masked row (and the mask's sense mapped).
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

B, T, H, DK = 2, 4, 2, 4
E = H * DK


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, T, E)).astype(np.float32)
    mask = rng.random((B, T, T)) < 0.6  # True attends (Keras' sense)
    mask[:, :, 0] = True  # every row attends to key 0 ...
    mask[0, 1, :] = False  # ... except batch 0, query 1: fully masked
    return x, mask


def keras_side() -> dict:
    import keras
    from _common import versions_tf

    keras.utils.set_random_seed(0)
    x, mask = data()
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=DK)
    fast = np.asarray(layer(x, x, attention_mask=mask))
    explicit, scores = layer(x, x, attention_mask=mask, return_attention_scores=True)
    causal = np.asarray(layer(x, x, use_causal_mask=True))  # the GPT mask, Keras' own flag
    causal_explicit, _ = layer(x, x, use_causal_mask=True, return_attention_scores=True)
    w = {p: (np.asarray(d.kernel), np.asarray(d.bias)) for p, d in
         zip("qkvo", (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense), strict=True)}
    return {"fast": fast, "explicit": np.asarray(explicit), "scores": np.asarray(scores), "w": w,
            "causal": causal, "causal_explicit": np.asarray(causal_explicit),
            **versions_tf()}


def torch_side(w: dict) -> dict:
    import torch
    from _common import versions_torch

    x, mask = data()
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([w[p][0].reshape(E, E) for p in "qkv"], 1).T))
        mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate([w[p][1].reshape(E) for p in "qkv"])))
        mha.out_proj.weight.copy_(torch.from_numpy(w["o"][0].reshape(E, E).T))
        mha.out_proj.bias.copy_(torch.from_numpy(w["o"][1]))
    xt = torch.from_numpy(x)
    blocked = torch.from_numpy(~mask).repeat_interleave(H, dim=0)  # [B*H, T, S], True blocks
    out = {}
    with torch.no_grad():
        out["need_weights=True"], weights = mha(xt, xt, xt, attn_mask=blocked, need_weights=True,
                                                average_attn_weights=False)
        out["need_weights=False (sdpa)"], _ = mha(xt, xt, xt, attn_mask=blocked, need_weights=False)
        out["Keras mask passed unchanged"], _ = mha(xt, xt, xt, attn_mask=torch.from_numpy(mask).repeat_interleave(H, 0),
                                                    need_weights=True)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)  # True blocks: keys after the query
        causal_w, _ = mha(xt, xt, xt, attn_mask=future, need_weights=True)
        causal_sdpa, _ = mha(xt, xt, xt, attn_mask=future, need_weights=False, is_causal=True)
    return {**{k: v.numpy() for k, v in out.items()}, "weights": weights.numpy(),
            "causal": {"need_weights=True": causal_w.numpy(), "need_weights=False, is_causal": causal_sdpa.numpy()},
            **versions_torch()}


def main() -> None:
    k = on_side(keras_side)
    t = on_side(torch_side, k["w"])
    _, mask = data()
    full = ~mask.any(-1)  # [B, T] fully masked rows
    print(f"keras {k['keras']}, torch {t['torch']}; fully masked rows: {np.argwhere(full).tolist()}")
    kf, ke = k["fast"][full], k["explicit"][full]
    bias = k["w"]["o"][1]
    print(f"Keras default path, fully masked row: weights uniform -> output {np.round(kf[0][:4], 4)}...")
    print(f"Keras explicit path, fully masked row: weights {np.unique(k['scores'][0, :, 1, :])} -> "
          f"output - o.bias = {max_abs(ke, bias[None]):.2g} (the output bias alone)")
    print(f"Keras default vs explicit path on that row: {max_abs(kf, ke):.3g}")
    torch_paths = [p for p in t if p not in ("weights", "torch", "causal") and p != "Keras mask passed unchanged"]
    for p in torch_paths:
        y = t[p]
        nans = int(np.isnan(y[full]).sum())
        print(f"torch {p}: fully masked row NaN values {nans}/{y[full].size}, "
              f"row = {np.round(y[full][0][:4], 4)}...; other rows vs Keras {max_abs(y[~full], k['fast'][~full]):.2g}")
    wrong = t["Keras mask passed unchanged"]
    print(f"Keras' mask passed to torch unchanged (sense not mapped): other rows off by "
          f"{np.nanmax(np.abs(wrong[~full] - k['fast'][~full])):.2g}")
    causal = max(max_abs(k[a], y) for a in ("causal", "causal_explicit") for y in t["causal"].values())
    print(f"causal (Keras use_causal_mask=True, both paths, vs torch's upper-triangular bool mask, both paths): {causal:.2g}")
    nan_any = any(np.isnan(t[p][full]).any() for p in torch_paths)
    held = bool(nan_any) and max_abs(kf, ke) > 1e-3
    result(
        "attention masks",
        held if held else "partly",
        f"fully masked row: Keras uniform vs zeros {max_abs(kf, ke):.2g}; torch "
        + ", ".join(f"{p}: {'NaN' if np.isnan(t[p][full]).any() else 'finite'}" for p in torch_paths)
        + f"; other rows {max(max_abs(t[p][~full], k['fast'][~full]) for p in torch_paths):.2g} after inverting"
        + f"; causal {causal:.2g}",
        "no fully masked row; mask sense inverted",
        "torch attn_mask = ~keras_mask; refuse fully masked rows",
    )


if __name__ == "__main__":
    main()
