"""Row "loss scaling, accumulation": initial scales; which gradients the finiteness check sees
under data parallelism; gradient accumulation under ``MirroredStrategy``.

    .venv/bin/python benchmarks/framework_differences/loss_scale.py

Code paths (installed versions):
  Keras 3.15  keras/src/optimizers/loss_scale_optimizer.py:49 ``initial_scale=2.0**15``.
              ``_tf_apply`` (line 256): under ``MirroredStrategy`` (no merge-call-free support)
              ``_handle_cross_replica`` runs ``check_finite`` on each replica's *own, not yet
              all-reduced* gradients and keeps replica 0's answer (lines 268-278; the comment
              says "Each replica computed the same `finite` value, since `grads` is all-reduced
              across replicas", which is not so: the all-reduce happens later, inside the inner
              optimizer's ``apply``, keras/src/backend/tensorflow/optimizer.py:159). A non-finite
              gradient on replica 1 only is therefore all-reduced and applied.
              ``gradient_accumulation_steps``: base_optimizer.py:551-585 puts the update (which
              calls ``merge_call``) inside ``ops.cond`` in the replica context.
  torch 2.13  torch/amp/grad_scaler.py:126 ``init_scale=2.0**16``; ``unscale_`` checks the
              gradients in ``param.grad`` (line 356 on), which DDP has already all-reduced in
              ``backward``: every rank sees the same inf and every rank skips. ``DDP.no_sync()``
              accumulates micro-batch gradients locally and all-reduces on the last backward.

Condition: the replica-0 check is wrong only when a non-finite gradient occurs on a replica other
than 0 (then Keras applies inf/NaN while torch skips the step); initial scales differ always
(mapping: ``initial_scale`` / ``init_scale`` set equal). This is a framework bug
(examples/framework-bugs/keras_loss_scale_replica0.py,
examples/framework-bugs/keras_gradient_accumulation_mirrored.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import numpy as np
from _common import on_side, result

BIG = 1e30  # one input value this large overflows float32 once the loss is scaled


def shards(bad: int) -> np.ndarray:
    """Two replicas' inputs [2, 2, 3]; replica ``bad`` holds one huge value (-1: none)."""
    x = np.random.default_rng(7).standard_normal((2, 2, 3)).astype(np.float32)
    if bad >= 0:
        x[bad, 0, 0] = BIG
    return x


def keras_side(bad: int) -> dict:
    import keras
    import tensorflow as tf
    from _common import tf_logical_cpus, versions_tf

    strategy = tf.distribute.MirroredStrategy(tf_logical_cpus(2))
    x = shards(bad)
    with strategy.scope():
        w = keras.Variable(np.full((3, 1), 0.5, np.float32))
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        opt.build([w])

    @tf.function
    def step(xs):
        def replica(xr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.matmul(xr, w))) / 4.0
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, [w])
            opt.apply_gradients(zip(grads, [w], strict=True))
        strategy.run(replica, args=(xs,))

    values = strategy.experimental_distribute_values_from_function(lambda c: x[c.replica_id_in_sync_group])
    scale0 = float(opt.dynamic_scale.numpy())
    step(values)
    return {"w": np.asarray(w).ravel(), "scale_before": scale0, "scale_after": float(opt.dynamic_scale.numpy()),
            **versions_tf()}


def keras_accumulation() -> str:
    import keras
    import tensorflow as tf
    from _common import tf_logical_cpus

    strategy = tf.distribute.MirroredStrategy(tf_logical_cpus(2))
    with strategy.scope():
        w = keras.Variable(np.ones((3, 1), np.float32))
        opt = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        opt.build([w])

    @tf.function
    def step(xs):
        def replica(xr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.matmul(xr, w)))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w], strict=True))
        strategy.run(replica, args=(xs,))

    values = strategy.experimental_distribute_values_from_function(lambda c: shards(-1)[c.replica_id_in_sync_group])
    try:
        step(values)
        step(values)
    except Exception as e:  # noqa: BLE001 - the point is to report what it raises
        text = str(e).replace("\x1b[1m", "").replace("\x1b[0m", "")
        cause = next((ln.strip() for ln in text.splitlines() if "merge_call" in ln), text.splitlines()[0])
        return f"{type(e).__name__}: {cause[:120]}"
    return "ran"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_rank(rank: int, bad: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.5)
    model = torch.nn.parallel.DistributedDataParallel(lin)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = torch.amp.GradScaler("cpu")
    scale0 = scaler.get_scale()
    x = torch.from_numpy(shards(bad)[rank])
    loss = (model(x) ** 2).sum() / 2.0  # the rank's mean: DDP averages, Keras' all-reduce sums
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    out = {"rank": rank, "w": lin.weight.detach().numpy().ravel().copy(), "scale_before": scale0,
           "scale_after": scaler.get_scale(), "torch": torch.__version__}
    # accumulation: two micro-batches, no_sync on the first, against the whole shard at once
    opt.zero_grad()
    xs = torch.from_numpy(shards(-1)[rank])
    with model.no_sync():
        (model(xs[:1]) ** 2).sum().backward()
    (model(xs[1:]) ** 2).sum().backward()
    acc = lin.weight.grad.clone()
    opt.zero_grad()
    (model(xs) ** 2).sum().backward()
    out["no_sync_vs_whole"] = float((acc - lin.weight.grad).abs().max())
    queue.put(out)
    dist.destroy_process_group()


def torch_ddp(bad: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=ddp_rank, args=(r, bad, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    outs = sorted((queue.get(timeout=300) for _ in procs), key=lambda o: o["rank"])
    for p in procs:
        p.join()
    return outs


def main() -> None:
    rows = {}
    for bad in (-1, 0, 1):
        k = on_side(keras_side, bad)
        t = torch_ddp(bad)
        where = {-1: "no replica", 0: "replica 0", 1: "replica 1"}[bad]
        applied_k = not np.isfinite(k["w"]).all() or not np.allclose(k["w"], 0.5)
        rows[bad] = (k, t)
        print(f"inf gradient on {where}:")
        print(f"  Keras LossScaleOptimizer, MirroredStrategy x2: scale {k['scale_before']:g} -> "
              f"{k['scale_after']:g}, w = {k['w']} ({'step applied' if applied_k else 'step skipped'})")
        for o in t:
            applied_t = not np.allclose(o["w"], 0.5)
            print(f"  torch GradScaler, DDP rank {o['rank']}: scale {o['scale_before']:g} -> "
                  f"{o['scale_after']:g}, w = {o['w']} ({'step applied' if applied_t else 'step skipped'})")
    acc = on_side(keras_accumulation)
    print(f"Keras SGD(gradient_accumulation_steps=2) under MirroredStrategy x2: {acc}")
    print(f"torch DDP no_sync accumulation vs the whole shard: {rows[-1][1][0]['no_sync_vs_whole']:.2g}")
    k1 = rows[1][0]
    k0 = rows[0][0]
    bug = (not np.isfinite(k1["w"]).all()) and k0["scale_after"] < k0["scale_before"]
    result(
        "loss scaling, accumulation",
        bool(bug) and acc != "ran",
        f"initial {k0['scale_before']:g} vs {rows[-1][1][0]['scale_before']:g}; inf on replica 1: Keras w = "
        f"{k1['w'][0]:g} (applied), torch skips; accumulation: {acc.split(':')[0]}",
        "no non-finite gradient outside replica 0; initial scales set equal",
        "initial_scale = init_scale; framework bugs (replica-0 check; accumulation under MirroredStrategy)",
    )


if __name__ == "__main__":
    main()
