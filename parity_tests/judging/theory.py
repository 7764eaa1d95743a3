"""What theory predicts for a pair of implementations on a case.

Two kinds of prediction:

*expected differences* — the two set-ups compute different updates in exact
arithmetic, so the judge must find a divergence (and a parity verdict would
itself be a failure: "unexpected parity");

*known differences* — documented, small effects that are not bugs but can show
up in a float64 comparison (Keras keeping ``learning_rate`` in float32), which
the verdict must name rather than hide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parity_tests.contract.optimizer import OPTIMIZERS, plugins_only

__all__ = ["Prediction", "predict", "is_parallel", "uneven_shards", "sampler_padding", "keras_rounds_hyperparameters", "KERAS_IMPLS",
           "LINEAR_OPTIMIZERS", "stage_of", "BFLOAT16_OPS", "mixed_precision_differences", "reported_loss_differs"]

#: where each predicted cause must first show in a step (CONTRACT §6 stages), by the words that name it
_STAGE_OF = (
    ("DistributedSampler padding", "inputs"),
    ("mixed precision", "forward"),
    ("local batch-norm statistics", "forward"),
    ("class weights", "loss"),
    ("label smoothing", "loss"),
    ("sum reduction", "combined_grads"),
    ("uneven shards with equal weighting", "combined_grads"),
    ("per-device gradients under synchronized batch norm", "clip"),
    ("clipping before vs after averaging", "clip"),
    ("clip_grad_norm_", "clip"),
    ("moving variance", "state"),
    ("param_mean", "update"),
    ("async", "update"),
)

PARALLEL = ("tf.towers", "tf.v1", "tf.mirrored", "torch.ddp")
# with synchronized batch norm, whose per-device gradient is d(own loss)/d(params) through every
# device's statistics; the others' (torch.ddp, tf.mirrored) is their share of d(sum of losses)
OWN_LOSS_GRADIENT = ("tf.towers",)


@dataclass(frozen=True)
class Prediction:
    """``expected``: causes of a predicted divergence; ``known``: documented small effects."""

    expected: tuple[str, ...]
    known: tuple[str, ...]

    @property
    def differ(self) -> bool:
        return bool(self.expected)


def stage_of(cause: str) -> str:
    """The stage where the predicted difference ``cause`` must appear first.

    Input, forward and loss differences come before the gradient; the
    combination of device gradients and clipping come after it; every
    optimizer-formula difference (epsilon placement, Keras' float32
    hyperparameters, weight decay, momentum holding the learning rate) is in
    the ``update`` with the gradients agreeing.
    """
    for words, stage in _STAGE_OF:
        if words in cause:
            return stage
    return "update"


def is_parallel(impl: str) -> bool:
    """Whether ``impl`` splits the global batch over devices (plugins: as the registry says)."""
    if impl in PARALLEL:
        return True
    found = _registered(impl)
    return bool(found and found.parallel)


def _registered(impl: str):
    """The registry's entry for a name that is not a built-in (a plugin or recorded run), if resolved."""
    if impl.startswith(("tf.", "torch.")):
        return None
    from parity_tests.running.registry import lookup

    return lookup(impl)


def _sizes(spec: dict[str, Any]) -> list[int]:
    b, n = spec["data"]["global_batch"], spec["parallel"]["devices"]
    if spec["parallel"]["shard"] == "strided":
        return [len(range(r, b, n)) for r in range(n)]
    return [b // n + (1 if r < b % n else 0) for r in range(n)]


def uneven_shards(spec: dict[str, Any]) -> bool:
    """True when the global batch does not divide evenly across the devices."""
    return len(set(_sizes(spec))) > 1


def sampler_padding(spec: dict[str, Any]) -> int:
    """Padded rows per epoch that the run reads with ``data.order: distributed_sampler`` (0 if none).

    ``DistributedSampler`` pads a dataset of D rows to ``N ceil(D/N)`` by
    repeating the epoch's first rows; they all fall in the epoch's last step
    (step ``ceil(D/B)``), so a run of fewer steps never reads them.
    """
    data, n = spec["data"], spec["parallel"]["devices"]
    if data.get("order", "split") != "distributed_sampler":
        return 0
    rows, batch = data["rows"], data["global_batch"]
    reaches_epoch_end = spec["steps"] >= -(-rows // batch)
    return (-rows) % n if reaches_epoch_end else 0


def _keras(impl: str) -> bool:
    """Whether ``impl``'s optimizers are Keras' (built-ins: the TensorFlow ones; plugins: unknown, so no)."""
    found = _registered(impl)
    return found.keras if found else impl in KERAS_IMPLS


def _framework(impl: str) -> str:
    """``tf`` or ``torch`` (plugins and recorded runs: as the registry says)."""
    found = _registered(impl)
    return found.framework if found else impl.split(".")[0]


def predict(spec: dict[str, Any], a: str, b: str) -> Prediction:
    """Predicted differences between implementations ``a`` and ``b`` on a validated case."""
    expected: list[str] = []
    known: list[str] = []
    par = spec["parallel"]
    n = par["devices"]
    one_parallel = is_parallel(a) != is_parallel(b) and n > 1
    if one_parallel:
        if spec["model"]["reduction"] == "sum":
            expected.append(
                f"sum reduction: {n} devices average per-device sums, i.e. the full-batch sum / {n}"
            )
        elif par["weighting"] == "equal" and uneven_shards(spec):
            expected.append(
                "uneven shards with equal weighting: the device mean weights rows of smaller shards more"
            )
        pad = sampler_padding(spec)
        if pad:
            expected.append(
                f"DistributedSampler padding: the last step of an epoch also reads the epoch's first {pad} row(s)"
                f" again, to give each of the {n} ranks ceil(rows/{n}) rows; DDP counts them as data, one device"
                " reads every row once"
            )
    opt = spec["optimizer"]
    fa, fb = _framework(a), _framework(b)
    if opt["name"] not in OPTIMIZERS or plugins_only(opt):  # kept as data for plugins: nothing to predict from
        known.append(f"optimizer {opt['name']!r} as the case gives it is not one the tool knows: theory predicts"
                     " nothing about it")
    elif opt["semantics"] == "native" and fa != fb:
        expected.extend(_native_optimizer_differences(spec))
        if spec["dtype"] == "float64" and (_keras(a) or _keras(b)):
            known.append(
                "Keras rounds learning_rate, momentum and Adam's bias-correction betas to float32 in a float64 run"
                " (and its schedules' rates, weight_decay and Adagrad's initial accumulator)"
            )
    if (opt["semantics"] == "native" and opt["name"] == "adam" and spec["dtype"] == "float64"
            and ("tf.v1" in (a, b)) and fa == fb and a != b):
        # measured: v1 vs Keras 3 native Adam on the poly case 1.2e-6 relative; same formula
        expected.append(
            "tf.compat.v1 AdamOptimizer rounds beta1, beta2 and epsilon to float32 and keeps beta^t in float32"
            " variables; Keras 3 computes the bias correction in the case dtype with epsilon exact"
        )
    clip = par.get("clip")
    if clip is not None:
        # a single device has nothing to average: per_device == after_combine there
        if clip["where"] == "per_device" and one_parallel:
            expected.append(
                "clipping before vs after averaging: each device's gradient is clipped, then averaged,"
                " which is not the clipped full-batch gradient (when a device's norm exceeds the threshold)"
            )
        has_bn = any(layer["type"] == "batch_norm" for layer in spec["model"]["layers"])
        if (clip["where"] == "per_device" and n > 1 and has_bn and par.get("batch_norm", "local") == "sync"
                and is_parallel(a) and is_parallel(b) and (a in OWN_LOSS_GRADIENT) != (b in OWN_LOSS_GRADIENT)):
            expected.append(
                "per-device gradients under synchronized batch norm: a tf.towers tower differentiates its own"
                " loss (through the shared statistics); torch SyncBatchNorm and tf.mirrored's all-reduce of the"
                " statistics are differentiated as all-reduces, so each rank or replica holds its share of the"
                " whole batch's gradient. The sums agree, the per-device norms (and so the clipping) do not"
            )
        if opt["semantics"] == "native" and fa != fb:
            # known, not expected: it shows only on steps where the threshold is reached
            known.append(
                "torch clip_grad_norm_ adds 1e-6 to the norm: scale c/(norm+1e-6) vs TensorFlow's c/norm,"
                " about 1e-6/norm relative on clipped steps"
            )
    if one_parallel:
        expected.extend(_combine_differences(spec))
    layer_expected, layer_known = _model_differences(spec, a, b, one_parallel)
    expected.extend(layer_expected)
    known.extend(layer_known)
    mixed_expected, mixed_known = mixed_precision_differences(spec, a, b)
    expected.extend(mixed_expected)
    known.extend(mixed_known)
    return Prediction(tuple(expected), tuple(known))


#: Which ops each framework runs in bfloat16 under dtype ``mixed_bfloat16`` (docs/mixed-precision.md).
#: Keras 3.15's ``mixed_bfloat16`` policy (``tfpar.models`` cites the lines): every layer casts its
#: input and every variable it reads to bfloat16, so each op of a layer rounds its result to bfloat16,
#: except batch norm (float32 inside) and the loss (float32). torch 2.13's CPU autocast (measured,
#: ``tests/test_mixed_precision.py``): only ops on its lower-precision list cast their operands, the
#: rest run in their inputs' promoted dtype.
BFLOAT16_OPS = {
    "tf": {
        "dense": "matmul, + bias (bias rounded to bfloat16), activation: each rounded to bfloat16",
        "conv2d": "conv, + bias (bias rounded to bfloat16; ops.add, whose gradient sums in float32),"
                  " activation: each rounded to bfloat16",
        "poly": "the powers, in bfloat16",
        "max_pool2d, flatten, dropout": "bfloat16",
        "batch_norm": "float32 statistics and normalisation, bfloat16 output",
        "loss": "float32, from the bfloat16 logits",
    },
    "torch": {
        "dense": "matmul in bfloat16; + bias in float32 (bfloat16 + float32 promotes), activation in float32;"
                 " the next matmul rounds it to bfloat16",
        "conv2d": "conv with the bias (cast to bfloat16) inside: one rounding; activation in bfloat16",
        "poly": "pow is on no autocast list: float32 (the next matmul rounds it)",
        "max_pool2d, flatten, dropout": "bfloat16 (the dtype of their input)",
        "batch_norm": "float32 statistics and normalisation, bfloat16 output",
        "loss": "float32 (torchref casts the output up; a dense last layer's logits are float32 already)",
    },
}


def reported_loss_differs(spec: dict[str, Any], a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` report different quantities as the loss of a ``mixed_bfloat16`` case.

    Keras' last dense layer rounds ``h W + b`` to bfloat16 and the loss is taken from those
    logits; torch's (bfloat16 product + float32 bias) are float32: the two losses differ
    by the logits' bfloat16 rounding even where the gradients, which both sides round
    to bfloat16 on the way back, agree. The judge then reports the loss beside the
    verdict instead of judging it (``tolerance``, "Mixed precision").
    """
    layers = spec["model"]["layers"]
    return (spec["dtype"] == "mixed_bfloat16" and _framework(a) != _framework(b)
            and layers[-1]["type"] == "dense" and bool(layers[-1]["use_bias"]))


def mixed_precision_differences(spec: dict[str, Any], a: str, b: str) -> tuple[list[str], list[str]]:
    """Where Keras' ``mixed_bfloat16`` policy and torch's CPU autocast round different values (:data:`BFLOAT16_OPS`).

    Only for dtype ``mixed_bfloat16`` and a pair from different frameworks (the same
    framework runs the same ops in the same dtypes, whatever the device count). Every
    difference is in the forward pass, so it must show first at the ``forward`` stage
    (layer 0's output at step 1, for a dense or conv first layer with a bias).

    They are *known* differences, not expected ones: each changes a value by at most one
    bfloat16 rounding (a relative ``2**-9``), the same size as the roundings the
    perturbation floor samples, so whether the trajectories part by more than the
    bound is a matter of measure, not of formula. Measured (docs/mixed-precision.md):
    on the seed MLP and the CNN at 1, 2 and 4 devices the gap stays below the bound
    (greatest gap/bound 0.89 on the MLP, whose every dense bias is the one the
    frameworks treat differently). A divergence in such a pair names them.
    """
    if spec["dtype"] != "mixed_bfloat16" or _framework(a) == _framework(b):
        return [], []
    layers = spec["model"]["layers"]
    known: list[str] = []
    dense = [i for i, layer in enumerate(layers) if layer["type"] == "dense"]
    if any(layers[i]["use_bias"] for i in dense):
        known.append(
            "mixed precision, dense bias: Keras rounds the bias to bfloat16 and adds it in bfloat16 (then the"
            " activation, in bfloat16); torch autocast runs only the matmul in bfloat16 and adds the float32 bias"
            " in float32 (type promotion), so its pre-activations and activations are float32 until the next"
            " matmul rounds them"
        )
        if dense[-1] == len(layers) - 1 and layers[-1]["use_bias"]:
            known.append(
                "mixed precision, logits: Keras' last dense layer returns bfloat16 logits (rounded once more before"
                " the float32 loss); torch's returns float32 logits (bfloat16 product + float32 bias)"
            )
    if any(layers[i]["activation"] in ("tanh", "sigmoid") for i in dense):
        known.append("mixed precision, activations: Keras computes tanh/sigmoid after a dense layer in bfloat16,"
                     " torch in float32")
    if any(layer["type"] == "conv2d" and layer["use_bias"] for layer in layers):
        known.append(
            "mixed precision, conv bias: torch's conv2d adds the bfloat16 bias inside the convolution (one"
            " rounding); Keras rounds the convolution, then adds the bfloat16 bias in bfloat16 (a second rounding)"
        )
    if any(layer["type"] == "poly" for layer in layers):
        known.append("mixed precision, poly: Keras computes the powers in bfloat16, torch's pow runs in float32"
                     " (on no autocast list) and the next matmul rounds them")
    return [], known


# optimizers whose update (and state) is linear in the gradient, for any schedule and weight decay:
# averaging N copies each updated from the same parameters equals one update by the mean gradient
LINEAR_OPTIMIZERS = ("sgd", "momentum", "nesterov")


def _combine_differences(spec: dict[str, Any]) -> list[str]:
    """param_mean and async against one device on the full batch (docs/combine-rules.md).

    param_mean with period 1 and a linear optimizer equals grad_mean (so only the causes
    above apply); a nonlinear optimizer or period > 1 (with a second step) makes it differ.
    async with N > 1 always applies N separate updates per step.
    """
    par, opt = spec["parallel"], spec["optimizer"]
    n, combine = par["devices"], par["combine"]
    out: list[str] = []
    if combine == "param_mean":
        if opt["name"] not in LINEAR_OPTIMIZERS:
            out.append(
                f"param_mean with {opt['name']}: each of the {n} devices applies its own nonlinear update"
                " (and keeps its own optimizer state); the mean of those is not one update by the mean gradient"
            )
        if par["period"] > 1 and spec["steps"] > 1:
            out.append(
                f"param_mean with period {par['period']}: between averages the {n} copies drift apart, so later"
                " gradients are taken at different parameters"
            )
    elif combine == "async":
        out.append(
            f"async: {n} separate updates per step, in a seeded order with staleness {par['staleness']},"
            " not one update by the combined gradient"
        )
    return out


def _loss_rule(spec: dict[str, Any], impl: str) -> str:
    """Whose loss formula ``impl`` computes: ``tf`` (Keras') or ``torch``."""
    sem = spec["model"].get("loss_semantics", "native")
    return _framework(impl) if sem == "native" else sem


def _model_differences(spec: dict[str, Any], a: str, b: str, one_parallel: bool) -> tuple[list[str], list[str]]:
    """Batch norm and loss options (see ``docs/layers.md``)."""
    expected: list[str] = []
    known: list[str] = []
    model, par = spec["model"], spec["parallel"]
    n = par["devices"]
    bns = [layer for layer in model["layers"] if layer["type"] == "batch_norm"]
    if bns and one_parallel and par.get("batch_norm", "local") == "local":
        expected.append(
            f"local batch-norm statistics: each of the {n} devices normalises with its own shard's mean and"
            " variance (and the moving statistics kept are device 0's), not the full batch's"
        )
    if any(layer["semantics"] == "native" for layer in bns) and _framework(a) != _framework(b):
        expected.append(
            "moving variance: unbiased vs biased (torch's running_var takes the batch variance times n/(n-1),"
            " Keras' moving_variance the batch variance itself)"
        )
    ra, rb = _loss_rule(spec, a), _loss_rule(spec, b)
    weights = model.get("class_weights")
    if weights is not None and any(w != 1.0 for w in weights):
        if model["reduction"] == "mean" and ra != rb:
            expected.append(
                "class-weight normalisation: Keras divides the weighted sum by the number of examples,"
                " torch by the sum of the targets' class weights"
            )
        if model["reduction"] == "mean" and ra == rb == "torch" and one_parallel and len(set(weights)) > 1:
            expected.append(
                "per-device weight sums: each device divides by its own shard's sum of class weights,"
                " so the mean over devices is not the full-batch weighted mean"
            )
        if model.get("label_smoothing", 0.0) and ra != rb and len(set(weights)) > 1:
            expected.append(
                "label smoothing with class weights: torch weights each class's smoothing term by that class's"
                " weight, Keras the whole smoothed example by its target's weight"
            )
    if spec["data"].get("sample_weights") is not None and model["reduction"] == "mean":
        if ra != rb:
            expected.append(
                "sample-weight normalisation: Keras divides the weighted sum by the number of examples,"
                " the torch idiom (v * l).sum() / v.sum() by the sum of the weights"
            )
        elif ra == "torch" and one_parallel:
            expected.append(
                "per-device sample-weight sums: each device divides by its own shard's sum of weights,"
                " so the mean over devices is not the full-batch weighted mean"
            )
    if not model.get("from_logits", True) and ra != rb:
        # exact for moderate logits; it grows as the sigmoid saturates (see docs/layers.md)
        known.append(
            "probabilities: Keras recovers the logits from the final sigmoid, torch's BCELoss uses the"
            " rounded probabilities and clamps its logs at -100 (visible once |logit| is large)"
        )
    return expected, known


def _native_optimizer_differences(spec: dict[str, Any]) -> list[str]:
    """What Keras' and torch's own optimizer classes do differently with the same nominal hyperparameters.

    See ``docs/optimizers.md`` for the formulas and measured gaps.
    """
    from parity_tests.contract.optimizer import lr_at

    opt = spec["optimizer"]
    name = opt["name"]
    out: list[str] = []
    if name in ("adam", "amsgrad", "adamw"):
        label = {"adam": "Adam", "amsgrad": "AMSGrad", "adamw": "AdamW"}[name]
        out.append(f"{label} epsilon placement: Keras adds eps to sqrt(v), torch to sqrt(v)/sqrt(1-beta2^t)")
    if name == "rmsprop":
        out.append("RMSprop epsilon placement: Keras sqrt(v + eps), torch sqrt(v) + eps")
    if name == "adagrad":
        out.append("Adagrad epsilon placement: Keras sqrt(s + eps), torch sqrt(s) + eps")
    if opt.get("weight_decay", 0.0) > 0 and name not in ("sgd", "adamw"):
        # plain SGD: p - lr(g + wd p) == p - lr wd p - lr g; AdamW is decoupled on both sides
        out.append(
            "weight decay: Keras decouples it (p -= p wd lr before the update), torch adds wd p to the gradient (L2)"
        )
    holds_lr = name in ("momentum", "nesterov") or (name == "rmsprop" and opt["momentum"] > 0)
    if holds_lr and len({lr_at(opt["schedule"], opt["lr"], t) for t in range(1, spec["steps"] + 1)}) > 1:
        out.append(
            "momentum holds lr: Keras' velocity includes the learning rate, torch's buffer does not,"
            " so they differ once the schedule changes the rate"
        )
    return out


# tf.v1's GradientDescentOptimizer / MomentumOptimizer round lr and momentum to
# float32 exactly as Keras does (measured: native tf.v1 == native tf.towers to 1e-15)
KERAS_IMPLS = ("tf.towers", "tf.single", "tf.mirrored", "tf.v1")


def keras_rounds_hyperparameters(spec: dict[str, Any], a: str, b: str) -> str | None:
    """The implementation to run with Keras' float32-rounded hyperparameters, or ``None``.

    In a float64 ``native`` run, Keras 3 rounds ``learning_rate`` and ``momentum``
    to float32 (measured: that rounding reproduces Keras' SGD to the last bit).
    For SGD and momentum this is the whole difference from the other framework's
    rule, so it can be mapped exactly: the non-Keras side runs with the same
    rounded values. (Adam's betas are rounded only inside Keras' bias
    correction, which no hyperparameter of torch's rule can reproduce; native
    Adam differs by its epsilon placement anyway.)
    """
    opt = spec["optimizer"]
    if spec["dtype"] != "float64" or opt["semantics"] != "native" or opt["name"] not in ("sgd", "momentum"):
        return None
    if opt.get("weight_decay", 0.0) or opt.get("schedule", {"kind": "constant"})["kind"] != "constant":
        # Keras also rounds weight_decay and a schedule's rates, which rounding lr and momentum
        # does not map (and a step schedule's lr must equal its first value)
        return None
    ka, kb = _keras(a), _keras(b)
    if ka == kb:
        return None
    side = b if ka else a
    found = _registered(side)
    if found is not None and not found.rerunnable:  # a recorded run cannot be run again with rounded values
        return None
    return side
