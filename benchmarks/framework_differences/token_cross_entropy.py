"""Not in issue 27's table: per-token ``softmax_ce`` with an ignored label (GPT's loss).

    .venv/bin/python benchmarks/framework_differences/token_cross_entropy.py

Code paths (installed versions):
  Keras 3.15  ``SparseCategoricalCrossentropy(ignore_class=c)``: keras/src/losses/losses.py:2347-2369
              zeroes the ignored positions' losses and attaches a mask; ``Loss.__call__`` turns
              the mask into weights ``total / valid`` (keras/src/losses/loss.py:197-214), so the
              ``sum_over_batch_size`` reduction is ``sum / valid`` (``divide_no_nan``: 0 when
              nothing is valid). The *function* ``keras.losses.sparse_categorical_crossentropy``
              returns the zeroed per-token losses; averaging them yourself divides by every
              position, ignored ones included.
  torch 2.13  ``F.cross_entropy(ignore_index=c)`` (reduction ``mean``): ``sum / valid``; with no
              valid position the loss is ``0 / 0 = NaN`` (its gradient is zeros).

Conditions: the class form of both agrees to rounding whenever a shard has at least one labelled
token; a shard (or micro-batch) whose tokens are all ignored gives Keras 0 and torch NaN (the
contract's "mean over every labelled position of a shard" is undefined there: the engine must
refuse it or define it). The function form plus a plain mean differs by the factor
``valid / total``.
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

B, T, K, IGNORE = 2, 6, 5, -1


def data(all_ignored: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((B, T, K)).astype(np.float32)
    labels = rng.integers(0, K, (B, T))
    labels[:, -2:] = IGNORE  # padding at the end of each sequence
    if all_ignored:
        labels[:] = IGNORE
    return logits, labels


def keras_side(all_ignored: bool) -> dict:
    import keras
    import tensorflow as tf

    logits, labels = data(all_ignored)
    x = tf.Variable(logits)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=IGNORE)
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, x)
    grad = tape.gradient(loss, x)
    per_token = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True, ignore_class=IGNORE)
    return {"loss": float(loss), "grad": np.asarray(grad), "function_mean": float(np.mean(per_token))}


def torch_side(all_ignored: bool) -> dict:
    import torch
    import torch.nn.functional as F

    logits, labels = data(all_ignored)
    x = torch.tensor(logits, requires_grad=True)
    loss = F.cross_entropy(x.reshape(-1, K), torch.from_numpy(labels).reshape(-1), ignore_index=IGNORE)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": x.grad.numpy()}


def main() -> None:
    k, t = on_side(keras_side, False), on_side(torch_side, False)
    print(f"some tokens ignored: loss Keras {k['loss']:.7g}, torch {t['loss']:.7g} (gap {abs(k['loss'] - t['loss']):.2g}); "
          f"gradient gap {max_abs(k['grad'], t['grad']):.2g}")
    _, labels = data(False)
    valid = float((labels != IGNORE).mean())
    print(f"  function form + mean: {k['function_mean']:.7g} = class form x valid/total "
          f"({k['loss'] * valid:.7g}); gap to torch {abs(k['function_mean'] - t['loss']):.2g}")
    k0, t0 = on_side(keras_side, True), on_side(torch_side, True)
    print(f"every token ignored: loss Keras {k0['loss']}, torch {t0['loss']}; gradient max |.| Keras "
          f"{np.abs(k0['grad']).max()}, torch {np.nanmax(np.abs(t0['grad']))} "
          f"(NaN entries {int(np.isnan(t0['grad']).sum())}/{t0['grad'].size})")
    result(
        "per-token softmax_ce, ignore_label (not in the table)",
        "new",
        f"{abs(k['loss'] - t['loss']):.2g} with labelled tokens; all ignored: Keras {k0['loss']:g}, torch {t0['loss']}",
        "every shard / micro-batch has a labelled token",
        "refuse (or define) a shard with no labelled token; use the class form's sum/valid",
    )


if __name__ == "__main__":
    main()
