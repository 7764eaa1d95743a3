"""Row "embedding + Adam, RMSprop, Adagrad": Keras squares each occurrence of a repeated token.

    .venv/bin/python benchmarks/framework_differences/embedding_sparse_moments.py

Code paths (installed versions):
  TF 2.21     ``tf.gather`` (Keras' ``Embedding.call`` -> ``ops.take``) has an ``IndexedSlices``
              gradient: one slice per occurrence, duplicates not summed.
  Keras 3.15  keras/src/optimizers/adam.py:125 ``update_step``: ``v += (square(g) - v)(1 - beta_2)``;
              ``ops.square`` of an ``IndexedSlices`` squares each slice and keeps the duplicate
              indices (keras/src/backend/tensorflow/sparse.py:382, ``elementwise_unary``); the
              subtraction then densifies (sparse.py:488: ``tf.convert_to_tensor``), which sums the
              duplicates: the second moment gets ``sum_i g_i^2`` instead of ``(sum_i g_i)^2``.
              The first moment is right (``subtract(g, m)`` densifies ``g`` first).
              rmsprop.py:126-130 (``square(gradient)``) and adagrad.py:85
              (``assign_add(accumulator, square(gradient))`` -> ``scatter_add`` per occurrence)
              do the same. Under ``MirroredStrategy`` the gradient's all-reduce concatenates the
              replicas' slices (keras/src/backend/tensorflow/optimizer.py:159), so a token seen
              once on each of two replicas is a duplicate too.
  torch 2.13  ``nn.Embedding`` (``sparse=False``) gives a dense gradient: ``(sum_i g_i)^2``.
              With ``sparse=True``, torch's own sparse optimizers coalesce (sum duplicates) first
              (torch/optim/adagrad.py:405: ``grad = grad.coalesce()  # the update is non-linear so indices
              must be unique``), so they agree with dense.

Closed form, Adam's first step (bias-corrected ``m = G``, ``v = sum g_i^2``, ``G = sum g_i``):
    Keras: ``lr G / sqrt(sum_i g_i^2)``, torch: ``lr sign(G)`` (eps aside)
so k identical occurrences move the row ``sqrt(k)`` times too far, and in general the gap is
``lr |G / sqrt(sum g_i^2) - sign G|`` per element. RMSprop's first step (``v = (1 - rho) sum g_i^2``)
and Adagrad's (``a = a0 + sum g_i^2``) follow the same substitution (``step1_gap``, checked below). Vanishes when no token id occurs twice in the
global batch (all replicas together). Mapping: ``embedding.gradient: dense`` (densify the
``IndexedSlices`` before the optimizer, ``tf.convert_to_tensor``), which sums the duplicates.
This is a framework bug (examples/framework-bugs/keras_embedding_sparse_second_moment.py).
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

V, D, LR, STEPS = 5, 3, 0.1, 3
TOKENS_REPEAT = np.array([1, 1, 2, 3])  # token 1 twice in the global batch
TOKENS_UNIQUE = np.array([0, 1, 2, 3])
OPTS = ("Adam", "RMSprop", "Adagrad")


def start() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.standard_normal((V, D)).astype(np.float32), rng.standard_normal((4, D)).astype(np.float32)


def keras_side(opt: str, tokens: np.ndarray, gradient: str, replicas: int) -> dict:
    import keras
    import tensorflow as tf
    from _common import tf_logical_cpus, versions_tf

    devices = tf_logical_cpus(replicas)
    strategy = tf.distribute.MirroredStrategy(devices) if replicas > 1 else tf.distribute.get_strategy()
    table, target = start()
    with strategy.scope():
        emb = keras.layers.Embedding(V, D, embeddings_initializer=keras.initializers.Constant(table))
        emb.build((None,))
        make = {
            "Adam": lambda: keras.optimizers.Adam(LR, beta_1=0.9, beta_2=0.999, epsilon=1e-8),
            "RMSprop": lambda: keras.optimizers.RMSprop(LR, rho=0.9, epsilon=1e-8),
            "Adagrad": lambda: keras.optimizers.Adagrad(LR, initial_accumulator_value=0.0, epsilon=1e-10),
        }
        optimizer = make[opt]()
        optimizer.build(emb.trainable_variables)
    per = len(tokens) // replicas
    kinds = []

    def step(ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(emb(ids) - y)) / len(tokens)
        (g,) = tape.gradient(loss, emb.trainable_variables)
        kinds.append(type(g).__name__)
        if gradient == "dense":
            g = tf.convert_to_tensor(g)
        optimizer.apply_gradients([(g, emb.embeddings)])

    traj = [table]
    for _ in range(STEPS):
        if replicas > 1:
            ids = strategy.experimental_distribute_values_from_function(
                lambda c: tokens[c.replica_id_in_sync_group * per:(c.replica_id_in_sync_group + 1) * per])
            ys = strategy.experimental_distribute_values_from_function(
                lambda c: target[c.replica_id_in_sync_group * per:(c.replica_id_in_sync_group + 1) * per])
            strategy.run(tf.function(step), args=(ids, ys))
        else:
            step(tokens, target)
        traj.append(np.asarray(emb.embeddings))
    return {"traj": np.stack(traj), "kind": kinds[0], **versions_tf()}


def torch_side(opt: str, tokens: np.ndarray, sparse: bool) -> dict:
    import torch
    from _common import versions_torch

    table, target = start()
    emb = torch.nn.Embedding(V, D, sparse=sparse)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(table))
    make = {
        "Adam": lambda p: torch.optim.Adam(p, LR, betas=(0.9, 0.999), eps=1e-8),
        "RMSprop": lambda p: torch.optim.RMSprop(p, LR, alpha=0.9, eps=1e-8),
        "Adagrad": lambda p: torch.optim.Adagrad(p, LR, initial_accumulator_value=0.0, eps=1e-10),
    }
    optimizer = make[opt](emb.parameters())
    traj = [table]
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((emb(torch.from_numpy(tokens)) - torch.from_numpy(target)) ** 2).sum() / len(tokens)
        loss.backward()
        optimizer.step()
        traj.append(emb.weight.detach().numpy().copy())
    return {"traj": np.stack(traj), **versions_torch()}


def step1_gap(opt: str, tokens: np.ndarray) -> float:
    """The closed form of the first step's gap from the per-occurrence gradients ``g_i``
    (``G = sum g_i``): Keras' second moment holds ``sum g_i^2`` where torch's holds ``G^2``."""
    table, target = start()
    g_occ = 2 * (table[tokens].astype(np.float64) - target) / len(tokens)  # [N, D]
    worst = 0.0
    for t in np.unique(tokens):
        g = g_occ[tokens == t]
        big_g, sq = g.sum(0), (g**2).sum(0)
        if opt == "Adam":  # bias-corrected m = G, v = sq (Keras) or G^2 (torch); eps 1e-8 outside
            keras, torch = big_g / (np.sqrt(sq) + 1e-8), big_g / (np.abs(big_g) + 1e-8)
        elif opt == "RMSprop":  # v = 0.1 sq; Keras lr g / sqrt(v + eps), torch lr g / (sqrt(v) + eps)
            keras, torch = big_g / np.sqrt(0.1 * sq + 1e-8), big_g / (np.sqrt(0.1 * big_g**2) + 1e-8)
        else:  # Adagrad from 0: Keras lr g / sqrt(a + eps), torch lr g / (sqrt(a) + eps)
            keras, torch = big_g / np.sqrt(sq + 1e-10), big_g / (np.abs(big_g) + 1e-10)
        worst = max(worst, float(np.max(np.abs(LR * (keras - torch)))))
    return worst


def main() -> None:
    gaps = {}
    for opt in OPTS:
        t = on_side(torch_side, opt, TOKENS_REPEAT, False)
        ts = on_side(torch_side, opt, TOKENS_REPEAT, True) if opt == "Adagrad" else None
        ks = on_side(keras_side, opt, TOKENS_REPEAT, "native", 1)
        kd = on_side(keras_side, opt, TOKENS_REPEAT, "dense", 1)
        km = on_side(keras_side, opt, TOKENS_REPEAT, "native", 2)
        ku = on_side(keras_side, opt, TOKENS_UNIQUE, "native", 1)
        tu = on_side(torch_side, opt, TOKENS_UNIQUE, False)
        gap = max_abs(ks["traj"][-1], t["traj"][-1])
        gaps[opt] = gap
        per_step = ", ".join(f"{max_abs(ks['traj'][s], t['traj'][s]):.3g}" for s in range(1, STEPS + 1))
        print(f"{opt}: Keras gradient {ks['kind']}; Keras native vs torch after steps 1..{STEPS}: {per_step}")
        print(f"  Keras with the gradient densified vs torch: {max_abs(kd['traj'][-1], t['traj'][-1]):.2g}; "
              f"MirroredStrategy, 2 replicas, token 1 once per replica: {max_abs(km['traj'][-1], t['traj'][-1]):.3g}; "
              f"no repeated token: {max_abs(ku['traj'][-1], tu['traj'][-1]):.2g}")
        if ts is not None:
            print(f"  torch nn.Embedding(sparse=True) + Adagrad (coalesces) vs dense: "
                  f"{max_abs(ts['traj'][-1], t['traj'][-1]):.2g}")
        print(f"  closed form, step 1: {step1_gap(opt, TOKENS_REPEAT):.4g}; measured "
              f"{max_abs(ks['traj'][1], t['traj'][1]):.4g}")
    result(
        "embedding sparse second moment",
        True,
        ", ".join(f"{gaps[o]:.2g} {o}" for o in OPTS) + f" after {STEPS} steps (lr {LR}, one token twice in 4)",
        "no token id twice in the global batch (all replicas together)",
        "embedding.gradient: dense (tf.convert_to_tensor before the optimizer); framework bug",
    )


if __name__ == "__main__":
    main()
