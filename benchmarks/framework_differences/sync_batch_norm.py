"""Row "synchronized batch norm": Keras' one-pass ``E[x^2] - E[x]^2`` in float32.

    .venv/bin/python benchmarks/framework_differences/sync_batch_norm.py

Code paths (installed versions):
  Keras 3.15  ``BatchNormalization(synchronized=True)`` -> keras/src/backend/tensorflow/nn.py:1492
              ``moments(synchronized=True)`` -> ``_compute_moments_sync`` (line 1515): each
              replica sums ``x`` and ``x^2`` (lines 1522-1523), the sums are all-reduced, and
              ``variance = max(E[x^2] - E[x]^2, 0)`` (line 1539), in float32 for float32 inputs
              (and for float16/bfloat16, which are cast up, line 1500). Not synchronized:
              ``tf.nn.moments`` (line 1548), two passes (mean, then squared deviations).
  torch 2.13  ``nn.SyncBatchNorm`` -> torch/nn/modules/_functions.py:39
              ``torch.batch_norm_stats`` (per-rank mean and invstd, Welford), all-gather, then
              line 106 ``torch.batch_norm_gather_stats_with_counts`` (the ranks' statistics merged
              with their counts, Chan's formula). Both kernels exist only for CUDA/XPU (on CPU:
              ``NotImplementedError: Could not run 'aten::batch_norm_stats' ... 'CPU' backend``,
              and SyncBatchNorm refuses CPU tensors, torch/nn/modules/batchnorm.py:852), so the
              torch column below is that algorithm written out in float32 numpy (no GPU here).

Size: ``E[x^2]`` rounds with a relative error of a few ``u = 2^-24`` (more with the count), so
the variance's absolute error is about ``c u (mu^2 + sigma^2)``: relative to ``sigma^2`` it grows
as ``(mu / sigma)^2``, and the normalised output moves by about ``|z| / 2`` times that. In float64
(``u = 2^-53``) it is invisible below mu/sigma ~ 1e4. Past ``mu/sigma ~ 2^12`` the computed
variance can round to 0 (the ``max(., 0)`` clamp) and the output blows up to ``|x - mu| / sqrt(eps)``. Condition: small ``mu / sigma``; zero only
in exact arithmetic. Mapping: none that keeps Keras' layer (a centred two-pass or Welford merge on
the TensorFlow side, ``semantics: torch``), or run the case in float64. Measured: the real Keras
layer under ``MirroredStrategy`` on 2 logical CPU devices, float32, against the float64 truth.
"""

from __future__ import annotations

import numpy as np
from _common import max_abs, on_side, result

REPLICAS, PER, C, EPS = 2, 64, 8, 1e-3
MEANS = (0.0, 10.0, 100.0, 300.0, 1000.0, 3000.0)


def batch(mu: float) -> np.ndarray:
    rng = np.random.default_rng(4)
    return (mu + rng.standard_normal((REPLICAS * PER, C))).astype(np.float32)


def keras_side() -> dict:
    import keras
    import tensorflow as tf
    from _common import tf_logical_cpus, versions_tf

    strategy = tf.distribute.MirroredStrategy(tf_logical_cpus(REPLICAS))
    with strategy.scope():
        sync = keras.layers.BatchNormalization(synchronized=True, epsilon=EPS)
        sync.build((None, C))
    local = keras.layers.BatchNormalization(epsilon=EPS)
    local.build((None, C))
    forward = tf.function(lambda s: sync(s, training=True), reduce_retracing=True)
    out = {}
    for mu in MEANS:
        x = batch(mu)
        shards = strategy.experimental_distribute_values_from_function(
            lambda ctx, x=x: x[ctx.replica_id_in_sync_group * PER:(ctx.replica_id_in_sync_group + 1) * PER])
        y = strategy.run(forward, args=(shards,))
        out[mu] = {"sync": np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(y)]),
                   "local": np.asarray(local(x, training=True))}
    return {"out": out, **versions_tf()}


def torch_algorithm(x: np.ndarray) -> np.ndarray:
    """SyncBatchNorm's statistics in float32: per-rank Welford, then the count-weighted merge."""
    f = np.float32
    means, invstds, counts = [], [], []
    for r in range(REPLICAS):
        xs = x[r * PER:(r + 1) * PER]
        mean = np.zeros(C, f)
        m2 = np.zeros(C, f)
        for i, row in enumerate(xs, start=1):  # Welford, as batch_norm_stats' kernel
            delta = row - mean
            mean = mean + delta / f(i)
            m2 = m2 + delta * (row - mean)
        var = m2 / f(len(xs))
        means.append(mean)
        invstds.append(f(1) / np.sqrt(var + f(EPS)))
        counts.append(f(len(xs)))
    # batch_norm_gather_stats_with_counts: back from invstd to var, Chan's parallel merge
    n, mean, m2 = f(0), np.zeros(C, f), np.zeros(C, f)
    for m_r, inv_r, n_r in zip(means, invstds, counts, strict=True):
        var_r = f(1) / (inv_r * inv_r) - f(EPS)
        delta = m_r - mean
        total = n + n_r
        mean = mean + delta * n_r / total
        m2 = m2 + var_r * n_r + delta * delta * n * n_r / total
        n = total
    return (x - mean) * (f(1) / np.sqrt(m2 / n + f(EPS)))


def truth(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - x.mean(0)) / np.sqrt(x.var(0) + EPS)


def main() -> None:
    k = on_side(keras_side)
    print(f"keras {k['keras']}: BatchNormalization(synchronized=True), {REPLICAS} replicas x {PER} rows, "
          f"{C} channels, sigma 1, float32; errors against the float64 normalisation")
    print(f"{'mean/std':>9s} {'Keras sync':>11s} {'Keras local':>12s} {'torch algo':>11s} {'sync - torch':>13s}")
    gaps = {}
    for mu in MEANS:
        x = batch(mu)
        t = truth(x)
        torch_y = torch_algorithm(x)
        ks, kl = k["out"][mu]["sync"], k["out"][mu]["local"]
        gaps[mu] = max_abs(ks, torch_y)
        print(f"{mu:9g} {max_abs(ks, t):11.2g} {max_abs(kl, t):12.2g} {max_abs(torch_y, t):11.2g} {gaps[mu]:13.2g}")
    result(
        "synchronized batch norm",
        True,
        f"{gaps[0.0]:.2g} (mean 0) to {gaps[1000.0]:.2g} (mean/std 1000), {gaps[3000.0]:.2g} at 3000, float32",
        "mean/std small (grows as u (mu/sigma)^2); float64",
        "a centred merge on the TensorFlow side (semantics torch) or float64; no field today",
    )


if __name__ == "__main__":
    main()
