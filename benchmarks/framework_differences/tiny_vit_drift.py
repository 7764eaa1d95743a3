"""The key-bias drift in a whole (tiny) ViT: is the attention key bias the only parameter of a
ViT block whose two correct float64 runs part beyond the judge's 1e-10?

    .venv/bin/python benchmarks/framework_differences/tiny_vit_drift.py

A one-block pre-norm ViT, each side written with its framework's own layers and functions:
patch ``Dense`` 4 -> 8, class token, learned position embedding, ``LayerNormalization`` /
``F.layer_norm`` (epsilon 1e-5 on both: the LayerNorm row mapped), ``MultiHeadAttention`` /
``F.multi_head_attention_forward`` (2 heads, key_dim 4: an exact scale), residual, LayerNorm,
MLP 8 -> 16 -> 8 (relu: GELU's float64 constant is another row), residual, LayerNorm, the class
token, a ``Dense`` head 8 -> 3, softmax cross entropy. Float64. As in attention_key_bias.py each
side is a worker that returns its gradients in one canonical layout, and one float64 Adam (torch's
formula, lr 1e-3, eps 1e-8) is applied to both, 4 steps. Printed: every parameter's judge-style
relative gap (``|A - B|_inf / max(|A|_inf, |B|_inf, 1e-2)``) after 4 steps, its largest recorded
gradient, and the proposed exemption's evidence test ``|g| <= n u G`` (``n`` = rows x tokens,
``G`` = the largest gradient entry of the layer) with the drift bound
``2 lr sum_t min(|g_t| / eps, B_t)``.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
from _common import result

B, P, PIX, D, H, DK, HID, K = 6, 4, 4, 8, 2, 4, 16, 3
T = P + 1
STEPS, LR, BETAS, EPS, LN_EPS = 4, 1e-3, (0.9, 0.999), 1e-8, 1e-5
U = 2.0**-53


def data() -> tuple[np.ndarray, np.ndarray, dict]:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((B, P, PIX))
    y = rng.integers(0, K, B)

    def glorot(*shape, fan=None):
        fan_in, fan_out = fan or (shape[0], shape[-1])
        lim = np.sqrt(6 / (fan_in + fan_out))
        return rng.uniform(-lim, lim, shape)

    p = {
        "patch.kernel": glorot(PIX, D), "patch.bias": np.zeros(D),
        "cls.token": 0.02 * rng.standard_normal((1, D)), "pos.embeddings": 0.02 * rng.standard_normal((T, D)),
        "ln1.gamma": np.ones(D), "ln1.beta": np.zeros(D),
        "ln2.gamma": np.ones(D), "ln2.beta": np.zeros(D),
        "ln3.gamma": np.ones(D), "ln3.beta": np.zeros(D),
        "mlp1.kernel": glorot(D, HID), "mlp1.bias": np.zeros(HID),
        "mlp2.kernel": glorot(HID, D), "mlp2.bias": np.zeros(D),
        "head.kernel": glorot(D, K), "head.bias": np.zeros(K),
    }
    for n in "qkv":
        p[f"att.{n}.kernel"] = glorot(D, H, DK, fan=(D, H * DK))
        p[f"att.{n}.bias"] = np.zeros((H, DK))
    p["att.o.kernel"] = glorot(H, DK, D, fan=(H * DK, D))
    p["att.o.bias"] = np.zeros(D)
    return x, y, p


def keras_worker(conn) -> None:
    import keras
    import tensorflow as tf

    x, y, p = data()
    f64 = "float64"
    layers = {
        "patch": keras.layers.Dense(D, dtype=f64), "mlp1": keras.layers.Dense(HID, activation="relu", dtype=f64),
        "mlp2": keras.layers.Dense(D, dtype=f64), "head": keras.layers.Dense(K, dtype=f64),
        **{f"ln{i}": keras.layers.LayerNormalization(epsilon=LN_EPS, dtype=f64) for i in (1, 2, 3)},
        "att": keras.layers.MultiHeadAttention(H, DK, dtype=f64),
    }
    cls = keras.Variable(p["cls.token"], dtype=f64)
    pos = keras.Variable(p["pos.embeddings"], dtype=f64)
    # dtype: a Keras loss object converts its inputs to floatx (float32) unless told otherwise
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=f64)

    def forward():
        h = layers["patch"](x)
        h = tf.concat([tf.repeat(cls[None], B, axis=0), h], axis=1) + pos
        a = layers["ln1"](h)
        h = h + layers["att"](a, a)
        h = h + layers["mlp2"](layers["mlp1"](layers["ln2"](h)))
        return ce(y, layers["head"](layers["ln3"](h)[:, 0]))

    forward()  # builds
    att = layers["att"]
    sub = {"q": att._query_dense, "k": att._key_dense, "v": att._value_dense, "o": att._output_dense}

    def variable(name):
        parts = name.split(".")
        if parts[0] == "cls":
            return cls
        if parts[0] == "pos":
            return pos
        if parts[0] == "att":
            return getattr(sub[parts[1]], parts[2])
        return getattr(layers[parts[0]], parts[1])

    while (params := conn.recv()) is not None:
        names = list(params)
        variables = [variable(n) for n in names]
        for v, n in zip(variables, names, strict=True):
            v.assign(params[n])
        with tf.GradientTape() as tape:
            loss = forward()
        grads = tape.gradient(loss, variables)
        conn.send({n: np.asarray(g) for n, g in zip(names, grads, strict=True)})


def torch_worker(conn) -> None:
    import torch
    import torch.nn.functional as F

    x, y, _ = data()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    while (params := conn.recv()) is not None:
        t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
        h = F.linear(tx, t["patch.kernel"].T, t["patch.bias"])
        h = torch.cat([t["cls.token"][None].expand(B, 1, D), h], 1) + t["pos.embeddings"]
        a = F.layer_norm(h, (D,), t["ln1.gamma"], t["ln1.beta"], LN_EPS).transpose(0, 1)
        w_in = torch.cat([t[f"att.{n}.kernel"].reshape(D, D) for n in "qkv"], 1).T
        b_in = torch.cat([t[f"att.{n}.bias"].reshape(D) for n in "qkv"])
        att, _ = F.multi_head_attention_forward(a, a, a, D, H, w_in, b_in, None, None, False, 0.0,
                                                t["att.o.kernel"].reshape(D, D).T, t["att.o.bias"],
                                                training=True, need_weights=False)
        h = h + att.transpose(0, 1)
        m = F.relu(F.linear(F.layer_norm(h, (D,), t["ln2.gamma"], t["ln2.beta"], LN_EPS),
                            t["mlp1.kernel"].T, t["mlp1.bias"]))
        h = h + F.linear(m, t["mlp2.kernel"].T, t["mlp2.bias"])
        c = F.layer_norm(h, (D,), t["ln3.gamma"], t["ln3.beta"], LN_EPS)[:, 0]
        F.cross_entropy(F.linear(c, t["head.kernel"].T, t["head.bias"]), ty).backward()
        conn.send({k: v.grad.numpy() for k, v in t.items()})


def run(worker) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(child,))
    proc.start()
    _, _, p = data()
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    grads = []
    for t in range(1, STEPS + 1):
        parent.send(p)
        g = parent.recv()
        grads.append(g)
        for k in p:
            m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * g[k]
            v2[k] = BETAS[1] * v2[k] + (1 - BETAS[1]) * g[k] ** 2
            p = {**p, k: p[k] - LR * (m[k] / (1 - BETAS[0] ** t)) / (np.sqrt(v2[k] / (1 - BETAS[1] ** t)) + EPS)}
    parent.send(None)
    proc.join()
    return {"p": p, "grads": grads}


def ratio_bound(t: int) -> float:
    b1, b2 = BETAS
    s = sum((b1 * b1 / b2) ** j for j in range(t))
    return (1 - b1) * np.sqrt(1 - b2**t) / ((1 - b1**t) * np.sqrt(1 - b2)) * np.sqrt(s)


def main() -> None:
    a, b = run(keras_worker), run(torch_worker)
    print(f"tiny ViT, float64, B={B} tokens={T}, Adam lr {LR} eps {EPS}, {STEPS} steps; Keras vs torch:")
    print(f"{'parameter':18s} {'rel. gap':>9s} {'max|g|':>9s} {'n u G':>9s} {'zero?':>6s} {'|diff|':>9s} {'bound':>9s}")
    over, exempt_ok = [], True
    for k in a["p"]:
        gap = float(np.abs(a["p"][k] - b["p"][k]).max() / max(np.abs(a["p"][k]).max(), np.abs(b["p"][k]).max(), 1e-2))
        gmax = max(float(np.abs(r["grads"][t][k]).max()) for r in (a, b) for t in range(STEPS))
        layer = k.rsplit(".", 1)[0] if not k.startswith("att.") else "att"
        big_g = max(float(np.abs(r["grads"][t][n]).max()) for r in (a, b) for t in range(STEPS)
                    for n in a["p"] if n.startswith(layer + "."))
        gamma = B * T * U * big_g
        zero = gmax <= gamma
        diff = float(np.abs(a["p"][k] - b["p"][k]).max())
        bound = sum(LR * min(float(np.abs(r["grads"][t][k]).max()) / EPS, ratio_bound(t + 1))
                    for r in (a, b) for t in range(STEPS))
        if gap > 1e-10:
            over.append(k)
            exempt_ok &= zero and diff <= bound
        print(f"{k:18s} {gap:9.2g} {gmax:9.2g} {gamma:9.2g} {'yes' if zero else 'no':>6s} {diff:9.2g} {bound:9.2g}")
    print(f"over 1e-10: {over}; all of them exempt by the proposed rule and within its bound: {exempt_ok}")
    result(
        "tiny ViT: parameters over 1e-10 between correct float64 runs",
        over == ["att.k.bias"],
        f"{', '.join(over) or 'none'}; exempt and within the drift bound: {exempt_ok}",
        "exact gradient zero (softmax shift invariance)",
        "judge k.bias against the drift bound (docs/framework-differences.md)",
    )


if __name__ == "__main__":
    main()
