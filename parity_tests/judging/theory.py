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

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.contract.model import nested_layers
from parity_tests.contract.optimizer import case_fields_for
from parity_tests.contract.specs import nested_inputs, output_shape, param_specs
from parity_tests.judging import tokens
from parity_tests.judging.attention_theory import (
    attention_scale_absent,
    attention_scale_text,
    native_attention_scales,
)
from parity_tests.protocol.engine import EngineSpec, declared
from parity_tests.protocol.optimizer_state import no_decay_names, plugins_only
from parity_tests.protocol.shards import shard_sizes

__all__ = ["Difference", "Prediction", "predict", "is_parallel", "uneven_shards", "sampler_padding",
           "KERAS_ROUNDED", "KERAS_ROUNDING", "mapping_changes", "LINEAR_OPTIMIZERS", "stage_of", "BFLOAT16_OPS",
           "mixed_precision_differences", "reported_loss_differs", "native_gelus",
           "bias_add_differences", "keras_bias_add_layers", "keras_adds_bias", "BIAS_ADD_OPS", "decays_any",
           "LOSS_SCALE", "loss_scale_difference", "BFLOAT16_ONLY"]

#: where each predicted cause must first show in a step (docs/localisation.md stages), by the words that name it
_STAGE_OF = (
    ("per-device sample-weight sums", "combined_grads"),  # each device's loss is right for its shard
    ("per-device weight sums", "combined_grads"),
    ("sample-weight normalisation", "loss"),
    ("probabilities", "loss"),
    ("DistributedSampler padding", "inputs"),
    ("mixed precision", "forward"),
    ("bias gradient summed in bfloat16", "device_grads"),
    ("GELU", "forward"),
    ("attention scale", "forward"),
    ("local batch-norm statistics", "forward"),
    ("synchronized batch-norm statistics", "forward"),
    ("micro-batch batch-norm statistics", "forward"),
    ("class weights", "loss"),
    ("label smoothing", "loss"),
    ("sum reduction", "combined_grads"),
    ("distribution loss scale", "loss"),  # the loss itself carries the factor, and every gradient from it
    ("uneven shards with equal weighting", "combined_grads"),
    ("per-device labelled counts", "combined_grads"),
    ("per-device gradients under synchronized batch norm", "clip"),
    ("clipping before vs after averaging", "clip"),
    ("sparse embedding clipping norm", "clip"),
    ("clip_grad_norm_", "clip"),
    ("moving variance", "state"),
    ("param_mean", "update"),
    ("async", "update"),
)



@dataclass(frozen=True)
class Difference:
    """One difference theory predicts between two implementations, at a case's values.

    Attributes:
        text: its name and how it arises (what the report prints).
        expected: ``True``: the two compute different updates in exact arithmetic (the judge
            must find it); ``False``: a *known* small effect, named where it shows.
        stage: the docs/localisation.md stage where it must appear first (:func:`stage_of`).
        certain: present whenever its condition holds, and of a size no bound can hide
            (it changes what is logged at step 1: the loss or the moving statistics);
            otherwise its size depends on the values, and a run where it stays within the
            bound is parity, not ``unexpected_parity``, unless a mapping proves it there.
        mapping: how a side the tool controls can be made to compute what the other side
            computes (:func:`mapping_changes`): ``optimizer``, ``weighting``, ``sum_weighting``, ``clip``,
            ``combine``, ``batch_norm``, ``micro_batches``, ``bn_semantics``, ``loss_semantics``, ``gelu_semantics``,
            ``attention_semantics``, ``embedding_gradient``, ``bias_semantics``; ``None``: no field of the case
            can express it.
    """

    text: str
    expected: bool = True
    stage: str = "update"
    certain: bool = False
    mapping: str | None = None
    #: the earliest stage where the *recorded* channels may show it, when that comes before ``stage``: a
    #: combination of devices changes the logged (combined) loss of step 1, which a comparison without
    #: per-device values localises at ``loss``; per-device clipping changes the combined gradient
    earliest: str | None = None
    #: the arithmetic that alone makes it: ``"bfloat16"`` for a difference of which values the two sides round
    #: to bfloat16 (a ``mixed_bfloat16`` recipe: :func:`mixed_precision_differences`, :func:`bias_add_differences`),
    #: which the float64 runs a mixed pair is held against compute none of, so it explains no gap between them
    #: (``pair.resolve``); ``None``: a difference of the formulas, in every dtype's runs
    only_in: str | None = None

    @property
    def first_visible(self) -> str:
        """The earliest stage a run that parts because of this difference can be localised at."""
        return self.earliest or self.stage


@dataclass(frozen=True)
class Prediction:
    """``expected``: causes of a predicted divergence; ``known``: documented small effects.

    ``differences`` holds both as :class:`Difference` (stage, certainty, mapping);
    ``absent`` names what the set-up would make differ but these values make zero
    (``"Adam epsilon placement: epsilon is 0"``), so a report can say why it is not predicted.
    """

    expected: tuple[str, ...]
    known: tuple[str, ...]
    differences: tuple[Difference, ...] = ()
    absent: tuple[str, ...] = ()

    @property
    def differ(self) -> bool:
        return bool(self.expected)

    @classmethod
    def of(cls, differences: list[Difference], absent: list[str]) -> Prediction:
        return cls(tuple(d.text for d in differences if d.expected), tuple(d.text for d in differences if not d.expected),
                   tuple(differences), tuple(absent))

    def mapped_by(self, kinds: set[str]) -> bool:
        """Whether every expected difference has a mapping among ``kinds``."""
        return all(d.mapping in kinds for d in self.differences if d.expected)


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


#: where the recorded channels may show a difference before its stage (``Difference.earliest``)
_EARLIEST = (
    ("sum reduction", "loss"),
    ("uneven shards with equal weighting", "loss"),
    ("per-device labelled counts", "loss"),
    ("per-device weight sums", "loss"),
    ("per-device sample-weight sums", "loss"),
    ("clipping before vs after averaging", "combined_grads"),
    ("per-device gradients under synchronized batch norm", "device_grads"),
)


#: :attr:`Difference.only_in` of a difference of the bfloat16 roundings alone
BFLOAT16_ONLY = "bfloat16"


def _diff(text: str, *, expected: bool = True, certain: bool = False, mapping: str | None = None,
          only_in: str | None = None) -> Difference:
    earliest = next((stage for words, stage in _EARLIEST if words in text), None)
    return Difference(text, expected, stage_of(text), certain, mapping, earliest, only_in)


#: the ``kind`` theory gives a name no declaration was found for (:func:`engine`)
UNDECLARED = "undeclared"

#: what theory's public functions take for an implementation: its declaration (the session resolves each
#: name once, ``running.registry``) or, for a test or a benchmark, its name (:func:`engine` reads the
#: declaration then)
Impl = EngineSpec | str


def engine(impl: Impl) -> EngineSpec:
    """What ``impl`` declares (``protocol.engine``): an :class:`EngineSpec` as given, or a name's declaration
    (every built-in, and a plugin or recorded run once the registry resolved it).

    A name nothing declared (a plugin not yet resolved, a test's stand-in) becomes an :class:`EngineSpec` of
    kind :data:`UNDECLARED`: theory then assumes nothing of it (one device, no Keras optimizer, its framework
    the name's first part, held as a built-in's in float32).

    Raises:
        LookupError: a built-in's name that was not declared in this process: theory would
            otherwise guess (the registry declares the built-ins on first use).
    """
    if isinstance(impl, EngineSpec):
        return impl
    found = declared(impl)
    if found is not None:
        return found
    if impl.startswith(("tf.", "torch.")):
        raise LookupError(f"{impl}: no declaration in this process (resolve names through"
                          " parity_tests.running.registry before asking theory)")
    return EngineSpec(impl, UNDECLARED, impl.split(".")[0], False, ())


def is_parallel(impl: Impl) -> bool:
    """Whether ``impl`` splits the global batch over devices (as it declares)."""
    return engine(impl).parallel


def _builtin_keras(impl: EngineSpec) -> bool:
    """A built-in whose optimizers are Keras' (made under floatx float32), or tf.compat.v1's SGD/momentum,
    which round ``lr`` and ``momentum`` exactly as Keras does (measured: native tf.v1 == native tf.towers to 1e-15)."""
    return impl.kind == "builtin" and impl.keras


def _sizes(spec: dict[str, Any]) -> list[int]:
    return shard_sizes(spec["data"]["global_batch"], spec["parallel"]["devices"], spec["parallel"]["shard"])


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


def _held(impl: EngineSpec, held: Mapping[str, str | None], spec: Mapping[str, Any] | None = None) -> str:
    """What ``impl``'s optimizer holds in float32 in a float64 run (``contract.optimizer.KERAS_ROUNDING``).

    Built-ins follow the case's semantics: under ``native`` Keras' classes made under floatx float32
    on the TensorFlow side and exact numbers on the torch side; under ``tf`` both frameworks' Keras
    rule holds what ``optimizer.keras_rounding`` says (``none`` by default: exact); under ``torch``
    exact numbers. A TensorFlow plugin says what it made once it has run, whatever the semantics
    (``held[impl]``, ``session.comparison.keras_rounding_of``, read from its float64 run where it
    made one: the run whose numbers decide; ``none`` when it made no Keras optimizer); before
    that, and for a TensorFlow recorded run, Keras' default (floatx float32) is assumed.
    """
    semantics = spec["optimizer"]["semantics"] if spec is not None else "native"
    if impl.kind in ("builtin", UNDECLARED):
        if semantics == "tf":
            return spec["optimizer"].get("keras_rounding", "none") if spec is not None else "none"
        return "floatx_float32" if semantics == "native" and _builtin_keras(impl) else "none"
    if impl.framework != "tf":
        return "none"
    return held.get(impl.name) or "floatx_float32"


def _f32_exact(v: float) -> bool:
    return float(np.float32(v)) == float(v)


def _rates(spec: dict[str, Any]) -> list[float]:
    """The learning rate of every step of the case (``lr_at``)."""
    from parity_tests.protocol.hyper import lr_at

    opt = spec["optimizer"]
    return [lr_at(opt["schedule"], opt["lr"], t) for t in range(1, spec["steps"] + 1)]


#: the mapping of Keras' distribution loss scale: the program itself rerun with the factor exact
#: (``session.comparison``; no case field expresses it, so ``mapping_changes`` has none)
LOSS_SCALE = "keras_loss_scale"


def loss_scale_difference(spec: dict[str, Any], a: Impl, b: Impl,
                          scales: Mapping[str, float | None]) -> Difference | None:
    """Keras' distribution loss scale in float32, where one side's float64 run carried it and the other's did not.

    ``scales``: per TensorFlow plugin, ``float32(1/N) N`` as its float64 run applied it
    (``protocol.hyper.keras_scale_factor`` of what ``tfpar.keras_seen.keras_loss_scales_seen`` read;
    ``None``: exact, as every built-in and torch side is). Keras 3.15.1's
    ``keras/src/losses/loss.py`` ``scale_loss_for_distribution`` multiplies the loss of a
    ``tf.distribute`` replica by ``ops.cast(1.0 / N, dtype)``, which passes float32: the loss, the
    logged loss and every gradient are that factor times the exact ones (``1 + 2^-25`` at N = 3,
    ``1 + 2^-26`` at 6, ...; nothing at N a power of two, where float32 holds 1/N exactly). Not
    ``certain``: in a float32 case the float32 rule may not resolve it. Mapped on the program
    itself (:data:`LOSS_SCALE`).
    """
    a, b = engine(a).name, engine(b).name
    sa, sb = scales.get(a), scales.get(b)
    if sa == sb:
        return None
    who = ", ".join(f"{x}: x {f!r} = 1 + {f - 1:.3g}" for x, f in ((a, sa), (b, sb)) if f is not None)
    n = spec["parallel"]["devices"]
    return _diff(
        f"Keras' distribution loss scale in float32: keras/src/losses/loss.py scale_loss_for_distribution multiplies"
        f" a replica's loss by ops.cast(1.0 / N, dtype), which passes float32 (float32(1/{n}) in a float64 run),"
        f" so the loss, the logged loss and every gradient of model.fit/compute_loss under a tf.distribute"
        f" strategy are float32(1/N) N times the exact ones ({who})", mapping=LOSS_SCALE)


def predict(spec: dict[str, Any], a: Impl, b: Impl, *, held: Mapping[str, str | None] | None = None,
            kernels: Mapping[str, Mapping[str, Any]] | None = None, own: Collection[str] = (),
            scales: Mapping[str, float | None] | None = None, own_schedule: Collection[str] = ()) -> Prediction:
    """Predicted differences between implementations ``a`` and ``b`` (their :class:`EngineSpec` s) on a validated case.

    Each prediction holds at the case's values: a difference whose size these values
    make exactly zero (epsilon 0, momentum 0, weight decay 0, a learning rate of 0 at
    every step, even shards, a hyperparameter float32 stores exactly, ...) is not
    predicted; it is named in :attr:`Prediction.absent` with the reason. What the
    values cannot settle (a clipping threshold reached or not, a difference whose size
    depends on the gradients) is predicted as not :attr:`Difference.certain`; the judge
    settles it by measuring the mapped run (``docs/tolerance.md``, "Predictions").

    ``kernels``: TensorFlow's kernel probe where the runs run (``running.kernels.probe("tf")["ops"]``;
    the session passes it for a ``mixed_bfloat16`` case), which says whether Keras' ``bias_add``
    gradient sums in bfloat16 here (:func:`bias_add_differences`; without it that difference is
    predicted wherever the layers have one).

    ``held``: for TensorFlow plugins that have run, what their Keras optimizers held in float32
    (``session.comparison.keras_rounding_of``: ``none``, ``floatx_float32``, ``floatx_float64``).

    ``own``: the plugins whose update rule is not their framework's class for the case, read from
    their runs (``session.comparison.own_rules``; a mapping gives each one's reason): a TensorFlow
    plugin that made no Keras or ``tf.compat.v1`` optimizer, a torch plugin that made no
    ``torch.optim`` one (Keras' Adam written out) or not the case's (``torch.optim.Adam`` where the
    case says ``adamw``, another ``eps``: ``torchref.torch_seen``). The case's ``native`` does not
    name their rule, so no difference between the frameworks' optimizer classes is predicted for
    them (predicting one would explain a real difference away).

    ``scales``: for TensorFlow plugins that have run, the factor Keras' distribution loss scale
    put on their float64 losses and gradients (:func:`loss_scale_difference`), read from the run.

    ``own_schedule``: the plugins whose learning rate is their own code's: every plugin that made no
    optimizer of its framework (``session.comparison.own_rules``), also one whose written-out rule was
    found to be its framework's class (``follows_its_class``, which takes it out of ``own``). Its
    rate is its code's, not Keras' ``CosineDecay``: :func:`_schedule_differences`.
    """
    a, b = engine(a), engine(b)
    held = held or {}
    found: list[Difference] = []
    absent: list[str] = []
    par = spec["parallel"]
    n = par["devices"]
    moves = any(r != 0 for r in _rates(spec))
    one_parallel = a.parallel != b.parallel and n > 1
    if one_parallel:
        if spec["model"]["reduction"] == "sum" and par["weighting"] != "sum":
            found.append(_diff(f"sum reduction: {n} devices average per-device sums, i.e. the full-batch sum / {n}",
                               certain=True, mapping="sum_weighting"))
        elif par["weighting"] == "equal" and uneven_shards(spec):
            found.append(_diff("uneven shards with equal weighting: the device mean weights rows of smaller shards more",
                               certain=True, mapping="weighting"))
        pad = sampler_padding(spec)
        if pad:
            found.append(_diff(
                f"DistributedSampler padding: the last step of an epoch also reads the epoch's first {pad} row(s)"
                f" again, to give each of the {n} ranks ceil(rows/{n}) rows; DDP counts them as data, one device"
                " reads every row once", certain=True))
    opt = spec["optimizer"]
    fa, fb = a.framework, b.framework
    known_opt = not plugins_only(opt)  # else kept as data for plugins: nothing known to predict from
    if not known_opt:
        fields = case_fields_for(opt)
        say = ("; the case says " + "; ".join(fields) + " (there the optimizer is one the tool knows)") if fields else ""
        absent.append(f"the optimizer {opt['name']!r} as the case gives it: not one the tool knows, so theory"
                      f" predicts nothing about it{say}")
    writes = [x.name for x in (a, b) if x.name in own]
    if known_opt and opt["semantics"] == "native" and fa != fb and writes:
        why = own.get(writes[0]) if isinstance(own, Mapping) else None
        absent.append(f"the frameworks' optimizer classes: {writes[0]} "
                      + (why or "made no Keras or tf.compat.v1 optimizer, so its update rule is its own code's")
                      + ", and theory predicts no difference of the optimizer for it")
    elif known_opt and opt["semantics"] == "native" and fa != fb:
        found.extend(_native_optimizer_differences(spec, moves, absent))
    # Keras' CosineDecay is a Keras optimizer's schedule: a rule written by hand has its own
    found.extend(_schedule_differences(spec, a, b, moves, absent, {*own, *own_schedule}))
    if known_opt and opt["semantics"] in ("native", "tf") and spec["dtype"] == "float64":
        # under ``tf`` too: a plugin's Keras class rounds as Keras does, whatever the case says the rule is
        ra, rb = (_keras_rounded(spec, _held(x, held, spec)) for x in (a, b))
        if ra != rb and moves:
            held_by = a.name if ra else b.name
            found.append(_diff(
                "Keras rounds learning_rate, momentum and Adam's bias-correction betas to float32 in a float64 run"
                f" (and its schedules' rates, weight_decay and Adagrad's initial accumulator): here {ra or rb}"
                f" ({held_by})" + (f", against {rb} ({b.name})" if ra and rb else ""), expected=False, mapping="optimizer"))
        elif _held(a, held, spec) != _held(b, held, spec):
            # the sides hold different roundings: say why they change nothing here (the same: nothing to say)
            absent.append("Keras' float32 hyperparameters: " + ("no step moves the parameters" if not moves else
                          "every hyperparameter Keras rounds is exact in float32" if not (ra or rb) else
                          "both sides round the same ones"))
    if (known_opt and opt["semantics"] == "native" and opt["name"] == "adam" and spec["dtype"] == "float64"
            and "tf.compat.v1" in (a.optimizer_family, b.optimizer_family) and fa == fb and a.name != b.name):
        # measured: v1 vs Keras 3 native Adam on the poly case 1.2e-6 relative; same formula
        if moves and not all(_f32_exact(opt[k]) for k in ("beta1", "beta2", "epsilon")):
            found.append(_diff(
                "tf.compat.v1 AdamOptimizer rounds beta1, beta2 and epsilon to float32 and keeps beta^t in float32"
                " variables; Keras 3 computes the bias correction in the case dtype with epsilon exact"))
        else:
            absent.append("tf.compat.v1 AdamOptimizer's float32 betas and epsilon: "
                          + ("no step moves the parameters" if not moves else "they are exact in float32"))
    clip = par.get("clip")
    if clip is not None:
        # a single device has nothing to average: per_device == after_combine there
        if clip["where"] == "per_device" and one_parallel:
            if moves:
                found.append(_diff(
                    "clipping before vs after averaging: each device's gradient is clipped, then averaged,"
                    " which is not the clipped full-batch gradient (when a device's norm exceeds the threshold)",
                    mapping="clip"))
            else:
                absent.append("clipping before vs after averaging: no step moves the parameters")
        has_bn = any(layer["type"] == "batch_norm" for _, layer in nested_layers(spec["model"]["layers"]))
        if (clip["where"] == "per_device" and n > 1 and has_bn and par.get("batch_norm", "local") == "sync"
                and a.parallel and b.parallel and a.sync_bn_gradient != b.sync_bn_gradient
                and moves):
            found.append(_diff(
                "per-device gradients under synchronized batch norm: a tf.towers tower differentiates its own"
                " loss (through the shared statistics); torch SyncBatchNorm and tf.mirrored's all-reduce of the"
                " statistics are differentiated as all-reduces, so each rank or replica holds its share of the"
                " whole batch's gradient. The sums agree, the per-device norms (and so the clipping) do not"))
        if opt["semantics"] == "native" and fa != fb and moves:
            # known, not expected: it shows only on steps where the threshold is reached
            found.append(_diff(
                "torch clip_grad_norm_ adds 1e-6 to the norm: scale c/(norm+1e-6) vs TensorFlow's c/norm,"
                " about 1e-6/norm relative on clipped steps", expected=False, mapping="optimizer"))
    if one_parallel:
        found.extend(_combine_differences(spec, moves, absent))
    scaled = loss_scale_difference(spec, a, b, scales or {})
    if scaled is not None:
        found.append(scaled)
    found.extend(_model_differences(spec, a, b, one_parallel, absent))
    found.extend(_token_differences(spec, a, b, one_parallel, moves, absent))
    mixed_expected, mixed_known = mixed_precision_differences(spec, a, b)
    found.extend(bias_add_differences(spec, a, b, absent, kernels))
    found.extend(_diff(t, only_in=BFLOAT16_ONLY) for t in mixed_expected)
    found.extend(_diff(t, expected=False, only_in=BFLOAT16_ONLY) for t in mixed_known)
    return Prediction.of(found, absent)


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
        "dense": "nn.Linear's F.linear: input, weight and bias cast to bfloat16, the bias added inside the product"
                 " (one rounding), bfloat16 out; activation in bfloat16",
        "conv2d": "conv with the bias (cast to bfloat16) inside: one rounding; activation in bfloat16",
        "poly": "pow is on no autocast list: float32 (the next matmul rounds it)",
        "max_pool2d, flatten, dropout": "bfloat16 (the dtype of their input)",
        "batch_norm": "float32 statistics and normalisation, bfloat16 output",
        "loss": "float32 (torchref casts the output up)",
        "layer_norm, rms_norm": "their input's dtype (float32 on a float32 stream), float32 weights",
        "residual add, position embedding, class token": "float32 + bfloat16 promotes to float32",
        "embedding": "float32 rows (on no autocast list)",
        "attention": "linear projections in bfloat16 (biases inside); scaled_dot_product_attention (or bmm,"
                     " softmax, bmm with dropout) on bfloat16",
    },
}
BFLOAT16_OPS["tf"].update({
    "layer_norm": "float32 inside (its input not cast, float32 gamma and beta), bfloat16 out",
    "rms_norm": "input and scale rounded to bfloat16, float32 inside, bfloat16 out",
    "residual add, position embedding, class token": "bfloat16 (Add casts both inputs; weights read as bfloat16)",
    "embedding": "float32 rows cast to bfloat16",
    "attention": "projections and biases bfloat16; without dropout float32 logits, scale, mask and softmax;"
                 " with dropout all bfloat16, the scale rounded to bfloat16",
    "global_avg_pool2d": "float32 mean, bfloat16 out",
})


def reported_loss_differs(spec: dict[str, Any], a: Impl, b: Impl) -> bool:
    """Whether ``a`` and ``b`` report different quantities as the loss of a ``mixed_bfloat16`` case.

    Keras' last dense layer rounds ``h W`` to bfloat16 and then ``+ b`` again, and the loss is
    taken from those logits; torch's ``nn.Linear`` adds the bias inside the product and rounds
    once: the two losses differ by a bfloat16 rounding of every logit even where the gradients
    agree to bfloat16 arithmetic. The judge then reports the mixed runs' loss beside the verdict
    instead of judging it (``perturbation``, "Mixed precision"); the pair's float64 runs round no
    logit, and their loss is judged by the float64 rule all the same (``judging.bfloat16.judge_bfloat16``).
    """
    layers = spec["model"]["layers"]
    return (spec["dtype"] == "mixed_bfloat16" and engine(a).framework != engine(b).framework
            and layers[-1]["type"] == "dense" and bool(layers[-1]["use_bias"]))


def mixed_precision_differences(spec: dict[str, Any], a: Impl, b: Impl) -> tuple[list[str], list[str]]:
    """Where Keras' ``mixed_bfloat16`` policy and torch's CPU autocast round different values (:data:`BFLOAT16_OPS`).

    Only for dtype ``mixed_bfloat16`` and a pair from different frameworks (the same
    framework runs the same ops in the same dtypes, whatever the device count). Every
    difference is in the forward pass, so it must show first at the ``forward`` stage
    (layer 0's output at step 1, for a dense or conv first layer with a bias).

    They are *known* differences, not expected ones: each is part of one side's bfloat16
    arithmetic (at most one bfloat16 rounding, a relative ``2**-8``, of a value the other side
    keeps in float32), and ``judging.bfloat16`` holds each side against its own float64 run,
    so a recipe difference moves neither side beyond what its arithmetic explains. Measured
    (docs/mixed-precision.md, 2026-11-26): parity on the seed MLP and the CNN at 1, 2 and 4
    devices with oneDNN's and with Eigen's kernels, and on 27 untuned dense cases
    (``benchmarks/bench_bfloat16_bound.py``). A divergence in such a pair names them.
    """
    if spec["dtype"] != "mixed_bfloat16" or engine(a).framework == engine(b).framework:
        return [], []
    layers = spec["model"]["layers"]
    known: list[str] = []
    dense = [i for i, layer in enumerate(layers) if layer["type"] == "dense"]
    if any(layers[i]["use_bias"] for i in dense):
        known.append(
            "mixed precision, dense bias: Keras rounds the product to bfloat16, then adds the bias (rounded to"
            " bfloat16) in bfloat16, a second rounding; torch's nn.Linear under autocast adds the bfloat16 bias"
            " inside the product and rounds once"
        )
        if dense[-1] == len(layers) - 1 and layers[-1]["use_bias"]:
            known.append(
                "mixed precision, logits: Keras' last dense layer rounds the logits twice (product, then + bias),"
                " torch's once, so the two float32 losses are taken from logits a bfloat16 rounding apart"
            )
    if any(layer["type"] == "conv2d" and layer["use_bias"] for layer in layers):
        known.append(
            "mixed precision, conv bias: torch's conv2d adds the bfloat16 bias inside the convolution (one"
            " rounding); Keras rounds the convolution, then adds the bfloat16 bias in bfloat16 (a second rounding)"
        )
    if any(layer["type"] == "poly" for layer in layers):
        known.append("mixed precision, poly: Keras computes the powers in bfloat16, torch's pow runs in float32"
                     " (on no autocast list) and the next matmul rounds them")
    known += _mixed_architecture_differences(spec)
    return [], known


def _mixed_architecture_differences(spec: dict[str, Any]) -> list[str]:
    """The architecture layers' recipe differences (docs/mixed-precision.md, "Architecture layers"): known ones,
    each within one bfloat16 rounding of a value the other side keeps in float32 (:data:`BFLOAT16_OPS`)."""
    kinds = {layer["type"] for _, layer in nested_layers(spec["model"]["layers"])}
    known = []
    if "residual" in kinds or "position_embedding" in kinds:
        known.append(
            "mixed precision, bfloat16 residual stream: Keras' Add casts both inputs to bfloat16 and adds in bfloat16,"
            " so the stream between blocks is rounded to bfloat16 at every residual add (and at the position"
            " embedding's); under torch autocast float32 + bfloat16 promotes to float32, so the stream stays float32")
    if "embedding" in kinds:
        known.append("mixed precision, embedding output: Keras' Embedding casts the gathered float32 rows to bfloat16;"
                     " torch's embedding is on no autocast list and returns them in float32")
    if "layer_norm" in kinds or "rms_norm" in kinds:
        known.append(
            "mixed precision, normalisation: Keras' LayerNormalization and RMSNormalization compute in float32 and"
            " return bfloat16 (RMSNormalization also rounds its input and scale to bfloat16 first); torch's layer_norm"
            " and rms_norm return their input's dtype (float32 on a float32 stream) with the float32 weights")
    if "attention" in kinds:
        known.append(
            "mixed precision, attention: Keras rounds q, k and v (each projection and its bias) to bfloat16; without"
            " dropout its logits, scale and softmax are float32 (dot_product_attention), with dropout all bfloat16 and"
            " the scale rounded to bfloat16; torch's scaled_dot_product_attention / bmm and softmax run on bfloat16"
            " inputs with float32 accumulation inside the kernel and its projections' biases in the linear")
    if kinds & {"global_avg_pool2d", "avg_pool2d", "depthwise_conv2d", "class_token", "tied_logits"}:
        known.append(
            "mixed precision, pooling and tokens: Keras' global average pooling averages in float32 and returns"
            " bfloat16, torch's mean returns its input's dtype; class tokens, position embeddings and the tied"
            " table are read as bfloat16 by Keras, as float32 by torch (promoting what they meet)")
    return known


#: which probed kernel sums a layer's bias gradient when Keras adds the bias with ``tf.nn.bias_add``
BIAS_ADD_OPS = {"dense": "dense bias_add gradient", "attention": "dense bias_add gradient",
                "conv2d": "conv2d bias_add gradient", "depthwise_conv2d": "conv2d bias_add gradient"}


def keras_adds_bias(layer: Mapping[str, Any]) -> bool:
    """Whether a ``mixed_bfloat16`` TensorFlow side adds ``layer``'s bias as Keras does, with ``tf.nn.bias_add``:
    a biased dense, conv2d, depthwise_conv2d or attention layer whose ``semantics`` is not ``torch``
    (``tfpar.bias.bias_add_fn``)."""
    return (layer["type"] in BIAS_ADD_OPS and bool(layer.get("use_bias", True))
            and layer.get("semantics", "native") != "torch")


def _bias_terms(in_shape: tuple[int, ...], layer: dict, rows: int) -> int:
    """How many values a bias-gradient element sums: ``rows`` x the output positions of ``layer``."""
    out = output_shape(in_shape, [layer]) if layer["type"] != "attention" else in_shape
    return rows * int(np.prod(out[:-1], dtype=np.int64))


def keras_bias_add_layers(spec: dict[str, Any], most: bool = False) -> list[tuple[str, str, int]]:
    """``(path, probe op, terms)`` of every layer whose bias a ``mixed_bfloat16`` TensorFlow side adds as Keras does,
    with ``tf.nn.bias_add`` (``tfpar.bias.keras_bias_add``; a layer's ``semantics: torch`` opts out); ``terms``:
    the values one bias-gradient element sums on the TensorFlow side that sums the fewest (a shard's micro-batch),
    or with ``most`` the most (one device, the whole batch)."""
    par = spec["parallel"]
    rows = spec["data"]["global_batch"] if most else max(
        spec["data"]["global_batch"] // par["devices"] // par.get("accumulate", 1), 1)
    out = []
    for path, layer, shape in nested_inputs(spec["model"]["input_shape"], spec["model"]["layers"]):
        if keras_adds_bias(layer):
            out.append((path, BIAS_ADD_OPS[layer["type"]], _bias_terms(shape, layer, rows)))
    return out


def bias_add_differences(spec: dict[str, Any], a: Impl, b: Impl, absent: list[str],
                         kernels: Mapping[str, Mapping[str, Any]] | None = None) -> list[Difference]:
    """Keras' bias gradient summed in bfloat16 (``tf.nn.bias_add``'s ``BiasAddGrad``) against torch's float32 sum.

    Expected (not certain: its size depends on the values) for a ``mixed_bfloat16`` pair of a TensorFlow side
    and a torch side where some layer's bias goes through ``bias_add`` (native semantics), the probe says
    that kernel sums in bfloat16 on this CPU (``running.kernels``), and a bias-gradient element sums at
    least 3 values (two values are rounded once either way). Mapped by ``semantics: torch`` on those layers
    of the TensorFlow side. **A TensorFlow/Keras weakness:** a real ``keras.layers.Dense(dtype="mixed_bfloat16")``
    over 4096 rows of ones returns a bias gradient of 256 (docs/mixed-precision.md, "Bias gradients").
    """
    if spec["dtype"] != "mixed_bfloat16" or {engine(a).framework, engine(b).framework} != {"tf", "torch"}:
        return []
    layers = keras_bias_add_layers(spec)
    if not layers:
        return []
    # the probe measured where the runs run (``running.kernels``, given by the session); without it, a
    # kernel that may sum in bfloat16 is assumed to (the prediction is not certain either way)
    ops = kernels or {}
    summed = [(p, op, n) for p, op, n in layers if ops.get(op, {}).get("accumulates", "bfloat16") == "bfloat16"]
    name = "bias gradient summed in bfloat16"
    if not summed:
        absent.append(f"{name}: TensorFlow's BiasAddGrad sums in float32 on this CPU (kernel probe)")
        return []
    many = [(p, op, n) for p, op, n in summed if n >= 3]
    if not many:
        absent.append(f"{name}: each bias-gradient element sums at most 2 values (one rounding either way)")
        return []
    where = ", ".join(f"layer {p} ({n} values" + (f", probe rho {ops[op]['rho']:.3g})" if op in ops else ")")
                      for p, op, n in many[:4])
    more = f" and {len(many) - 4} more" if len(many) > 4 else ""
    return [_diff(f"{name}: Keras adds these biases with tf.nn.bias_add, whose gradient BiasAddGrad sums the"
                  f" bfloat16 output gradient in bfloat16 here ({where}{more}); torch sums a float32 bias's gradient"
                  " in float32", mapping="bias_semantics", only_in=BFLOAT16_ONLY)]


# optimizers whose update (and state) is linear in the gradient, for any schedule and weight decay:
# averaging N copies each updated from the same parameters equals one update by the mean gradient
LINEAR_OPTIMIZERS = ("sgd", "momentum", "nesterov")


def _combine_differences(spec: dict[str, Any], moves: bool, absent: list[str]) -> list[Difference]:
    """param_mean and async against one device on the full batch (docs/combine-rules.md).

    param_mean with period 1 and a linear optimizer equals grad_mean (so only the causes
    above apply); a nonlinear optimizer or period > 1 (with a second step) makes it differ.
    async with N > 1 always applies N separate updates per step. None of them moves a
    parameter when no step's learning rate is non-zero. Mapped by running the parallel
    side with ``combine: grad_mean``.
    """
    par, opt = spec["parallel"], spec["optimizer"]
    n, combine = par["devices"], par["combine"]
    out: list[Difference] = []
    if combine not in ("param_mean", "async"):
        return out
    if not moves:
        absent.append(f"{combine}: no step moves the parameters")
        return out
    if combine == "param_mean":
        if opt["name"] not in LINEAR_OPTIMIZERS:
            out.append(_diff(
                f"param_mean with {opt['name']}: each of the {n} devices applies its own nonlinear update"
                " (and keeps its own optimizer state); the mean of those is not one update by the mean gradient",
                mapping="combine"))
        if par["period"] > 1 and spec["steps"] > 1:
            out.append(_diff(
                f"param_mean with period {par['period']}: between averages the {n} copies drift apart, so later"
                " gradients are taken at different parameters", mapping="combine"))
    else:
        out.append(_diff(
            f"async: {n} separate updates per step, in a seeded order with staleness {par['staleness']},"
            " not one update by the combined gradient", mapping="combine"))
    return out


def _loss_rule(spec: dict[str, Any], impl: EngineSpec) -> str:
    """Whose loss formula ``impl`` computes: ``tf`` (Keras') or ``torch``."""
    sem = spec["model"].get("loss_semantics", "native")
    return impl.framework if sem == "native" else sem


def _model_differences(spec: dict[str, Any], a: EngineSpec, b: EngineSpec, one_parallel: bool,
                       absent: list[str]) -> list[Difference]:
    """Batch norm and loss options (see ``docs/layers.md``)."""
    out: list[Difference] = []
    model, par = spec["model"], spec["parallel"]
    n = par["devices"]
    bns = [(path, layer) for path, layer in nested_layers(model["layers"]) if layer["type"] == "batch_norm"]
    if bns and one_parallel and par.get("batch_norm", "local") == "local":
        out.append(_diff(
            f"local batch-norm statistics: each of the {n} devices normalises with its own shard's mean and"
            " variance (and the moving statistics kept are device 0's), not the full batch's",
            certain=True, mapping="batch_norm"))
    k = par.get("accumulate", 1)
    if bns and one_parallel and k > 1:
        if par["shard"] == "strided" and spec["data"]["global_batch"] % n == 0:
            absent.append(f"micro-batch batch-norm statistics (accumulate {k}): with strided shards the devices'"
                          " micro-batch j together are the single device's micro-batch j")
        else:
            out.append(_diff(
                f"micro-batch batch-norm statistics: with accumulate {k}, the devices' micro-batch j (the j-th of"
                f" each shard's {k} parts) together are not the single device's micro-batch j (the j-th of the"
                f" global batch's {k} contiguous parts), so even synchronized statistics are over other rows",
                certain=True,
                mapping="micro_batches"))
    native_bn = [layer for _, layer in bns if layer["semantics"] == "native"]
    if native_bn and par.get("batch_norm", "local") == "sync" and a.framework != b.framework:
        # docs/layers.md "Synchronized statistics: one pass vs merged"; the size needs the activations
        if spec["dtype"] == "float64":
            absent.append("synchronized batch-norm statistics, one pass vs merged: in float64 the one pass loses"
                          " about (mean/std)^2 1.1e-16 of the variance, below the bound unless a channel's mean"
                          " exceeds about 1e3 times its spread")
        else:
            out.append(_diff(
                "synchronized batch-norm statistics: Keras sums x and x^2 in one pass (var = E[x^2] - E[x]^2),"
                " torch's SyncBatchNorm merges each rank's mean and variance with the counts; equal in exact"
                " arithmetic, the one pass loses about (mean/std)^2 6e-8 of the variance in float32, so the gap"
                " shows where a channel's mean is large against its spread", expected=False, mapping="bn_semantics"))
    if native_bn and a.framework != b.framework:
        if any(layer["momentum"] != 1.0 for layer in native_bn):
            out.append(_diff(
                "moving variance: unbiased vs biased (torch's running_var takes the batch variance times n/(n-1),"
                " Keras' moving_variance the batch variance itself)", certain=True, mapping="bn_semantics"))
        else:
            absent.append("moving variance unbiased vs biased: momentum 1 never updates the moving statistics")
    gelus = native_gelus(model["layers"])
    if gelus and a.framework != b.framework:
        if spec["dtype"] == "float64":
            out.append(_diff(
                "float64 GELU constants: TensorFlow's tf.nn.gelu (Keras' gelu) rounds 1/sqrt(2) (erf form) or"
                " 0.044715 (tanh form) through float32, torch's F.gelu computes them exactly (about 5e-10"
                f" relative on the activation; model.layers.{', model.layers.'.join(gelus)})",
                expected=False, mapping="gelu_semantics"))
        else:
            absent.append("float64 GELU constants: the case computes in "
                          f"{spec['dtype']}, where both sides' GELU constants are float32 values")
    scales = native_attention_scales(spec)
    if scales and a.framework != b.framework:
        if spec["dtype"] == "float64" and any(delta > 0.0 for _, delta in scales):
            out.append(_diff(attention_scale_text(scales), expected=False, mapping="attention_semantics"))
        else:
            absent.append(attention_scale_absent(spec["dtype"], scales))
    ra, rb = _loss_rule(spec, a), _loss_rule(spec, b)
    weights = model.get("class_weights")
    if weights is not None and any(w != 1.0 for w in weights):
        if model["reduction"] == "mean" and ra != rb:
            out.append(_diff(
                "class-weight normalisation: Keras divides the weighted sum by the number of examples,"
                " torch by the sum of the targets' class weights", certain=True, mapping="loss_semantics"))
        if model["reduction"] == "mean" and ra == rb == "torch" and one_parallel and len(set(weights)) > 1:
            out.append(_diff(
                "per-device weight sums: each device divides by its own shard's sum of class weights,"
                " so the mean over devices is not the full-batch weighted mean"))
        if model.get("label_smoothing", 0.0) and ra != rb and len(set(weights)) > 1:
            out.append(_diff(
                "label smoothing with class weights: torch weights each class's smoothing term by that class's"
                " weight, Keras the whole smoothed example by its target's weight", certain=True,
                mapping="loss_semantics"))
    if spec["data"].get("sample_weights") is not None and model["reduction"] == "mean":
        if ra != rb:
            out.append(_diff(
                "sample-weight normalisation: Keras divides the weighted sum by the number of examples,"
                " the torch idiom (v * l).sum() / v.sum() by the sum of the weights", mapping="loss_semantics"))
        elif ra == "torch" and one_parallel:
            out.append(_diff(
                "per-device sample-weight sums: each device divides by its own shard's sum of weights,"
                " so the mean over devices is not the full-batch weighted mean"))
    if not model.get("from_logits", True) and ra != rb:
        # exact for moderate logits; it grows as the sigmoid saturates (see docs/layers.md)
        out.append(_diff(
            "probabilities: Keras recovers the logits from the final sigmoid, torch's BCELoss uses the"
            " rounded probabilities and clamps its logs at -100 (visible once |logit| is large)",
            expected=False, mapping="loss_semantics"))
    return out


def _keras_sparse(impl: EngineSpec) -> bool:
    """A built-in TensorFlow engine whose optimizers are Keras' classes: they receive an embedding's
    ``IndexedSlices`` as Keras' ``apply_gradients`` does (``judging.tokens``)."""
    return impl.kind == "builtin" and impl.framework == "tf" and impl.optimizer_family == "keras"


def _tf_builtin(impl: EngineSpec) -> tuple[bool, str]:
    """(a built-in TensorFlow engine, its optimizer family) for ``judging.tokens``."""
    return impl.kind == "builtin" and impl.framework == "tf", impl.optimizer_family


def _token_differences(spec: dict[str, Any], a: EngineSpec, b: EngineSpec, one_parallel: bool, moves: bool,
                       absent: list[str]) -> list[Difference]:
    """Keras' sparse embedding second moment and per-device labelled counts (``judging.tokens``)."""
    out: list[Difference] = []
    text = tokens.sparse_moment(spec, _keras_sparse(a), _keras_sparse(b), moves, absent)
    if text:
        out.append(_diff(text, mapping="embedding_gradient"))
    text = tokens.sparse_clip_norm(spec, _tf_builtin(a), _tf_builtin(b), moves, absent)
    if text:
        out.append(_diff(text, mapping="embedding_gradient"))
    text = tokens.labelled_counts(spec, one_parallel)
    if text:  # not certain: only the steps whose shards hold unequal counts differ (lockstep judges each alone)
        out.append(_diff(text))
    return out


def native_gelus(layers: list[dict]) -> list[str]:
    """Spec paths (``3``, ``1.body.0``) of every layer whose GELU computes each framework's own
    constants (``semantics: native``), nested bodies and shortcuts included."""
    return [".".join(map(str, path)) for path, layer in nested_layers(layers)
            if layer.get("activation", layer.get("fn")) in ("gelu", "gelu_tanh") and layer.get("semantics") == "native"]


def _native_optimizer_differences(spec: dict[str, Any], moves: bool, absent: list[str]) -> list[Difference]:
    """What Keras' and torch's own optimizer classes do differently with the same nominal hyperparameters.

    Each is predicted only where these values make it non-zero (``docs/optimizers.md``
    has the formulas and the measured gaps):

    * Adam/AMSGrad/AdamW epsilon placement: Keras' rule is torch's with
      ``eps_torch = eps sqrt(1 - beta2^t)``; equal when ``eps = 0`` or ``beta2 = 0``;
    * RMSprop and Adagrad epsilon: ``sqrt(v + eps)`` vs ``sqrt(v) + eps``; equal when ``eps = 0``;
    * weight decay: decoupled (Keras) vs L2 in the gradient (torch): equal when ``wd = 0``,
      for plain SGD, for momentum/Nesterov with ``momentum = 0`` (plain SGD), and for AdamW;
    * momentum holding lr: equal unless ``momentum > 0`` and the schedule changes the rate;
    * none of them when no step's learning rate is non-zero.

    All are mapped by running a side the tool controls with the other framework's rule
    (``mapping="optimizer"``: :func:`mapping_changes`).
    """
    opt = spec["optimizer"]
    name = opt["name"]
    out: list[Difference] = []
    if not moves:
        absent.append(f"{name}: every step's learning rate is 0, so no optimizer rule moves the parameters")
        return out
    label = {"adam": "Adam", "amsgrad": "AMSGrad", "adamw": "AdamW", "rmsprop": "RMSprop", "adagrad": "Adagrad"}.get(name)
    if name in ("adam", "amsgrad", "adamw"):
        if opt["epsilon"] > 0 and opt["beta2"] != 0:
            out.append(_diff(f"{label} epsilon placement: Keras adds eps to sqrt(v), torch to sqrt(v)/sqrt(1-beta2^t)",
                             mapping="optimizer"))
        else:
            absent.append(f"{label} epsilon placement: " + ("epsilon is 0" if opt["epsilon"] == 0 else
                                                            "beta2 is 0, so sqrt(1-beta2^t) is 1"))
    if name in ("rmsprop", "adagrad"):
        inside = "Keras sqrt(v + eps), torch sqrt(v) + eps" if name == "rmsprop" else "Keras sqrt(s + eps), torch sqrt(s) + eps"
        if opt["epsilon"] > 0:
            out.append(_diff(f"{label} epsilon placement: {inside}", mapping="optimizer"))
        else:
            absent.append(f"{label} epsilon placement: epsilon is 0")
    wd = opt.get("weight_decay", 0.0)
    plain = name == "sgd" or (name in ("momentum", "nesterov") and opt["momentum"] == 0) or name == "adamw"
    if wd > 0 and not decays_any(spec):
        absent.append("weight decay decoupled vs L2: optimizer.no_decay excludes every trainable parameter")
    elif wd > 0 and not plain:
        # plain SGD: p - lr(g + wd p) == p - lr wd p - lr g; AdamW is decoupled on both sides
        out.append(_diff(
            "weight decay: Keras decouples it (p -= p wd lr before the update), torch adds wd p to the gradient (L2)",
            mapping="optimizer"))
    elif wd > 0:
        absent.append("weight decay decoupled vs L2: the same update for "
                      + ("AdamW (decoupled on both sides)" if name == "adamw" else "plain SGD"))
    mu = opt.get("momentum", 0.0) if name in ("momentum", "nesterov", "rmsprop") else 0.0
    changing = len(set(_rates(spec))) > 1
    if mu > 0 and changing:
        out.append(_diff(
            "momentum holds lr: Keras' velocity includes the learning rate, torch's buffer does not,"
            " so they differ once the schedule changes the rate", mapping="optimizer"))
    elif mu > 0:
        absent.append("momentum holding lr: the learning rate is the same at every step")
    return out


def decays_any(spec: dict[str, Any]) -> bool:
    """Whether weight decay reaches any trainable parameter: ``optimizer.no_decay`` may exclude them all.

    An external model's names are the plugins' (the case's ``init`` npz): theory does not read them and
    assumes a parameter is decayed.
    """
    opt = spec["optimizer"]
    if not opt.get("no_decay") or "external" in spec["model"]:
        return True
    names = [sp.name for sp in param_specs(spec["model"]["input_shape"], spec["model"]["layers"]) if sp.trainable]
    return len(no_decay_names(opt, names)) < len(names)


def _runs_cosine_decay(spec: Mapping[str, Any], impl: EngineSpec, own_schedule: Collection[str]) -> bool:
    """Whether ``impl`` runs Keras' ``CosineDecay`` for the case's ``warmup_cosine``: a TensorFlow side with a
    Keras optimizer (a built-in, or a plugin that made one) under ``native``. A side whose rate is its own
    code's (``own_schedule``), a torch side, and every side under ``torch`` or ``tf`` compute the curve."""
    return (spec["optimizer"]["semantics"] == "native" and impl.framework == "tf"
            and impl.optimizer_family != "tf.compat.v1" and impl.name not in own_schedule)


def _schedule_differences(spec: dict[str, Any], a: EngineSpec, b: EngineSpec, moves: bool, absent: list[str],
                          own_schedule: Collection[str] = ()) -> list[Difference]:
    """What the frameworks' own ``warmup_cosine`` classes do differently (docs/framework-differences.md, "Warm-up + cosine").

    Under ``native`` a TensorFlow side with a Keras optimizer runs Keras' ``CosineDecay`` and the torch
    side torch's ``SequentialLR(LinearLR, CosineAnnealingLR, ConstantLR)`` (``tfpar.optimizers.keras_schedule``,
    ``torchref.optimizers.warmup_cosine_scheduler``); a plugin that writes its rule out computes its own
    rate (``own_schedule``: the case's curve, as far as the tool knows):

    * Keras one step late (expected, ``mapping="optimizer"``): ``CosineDecay`` evaluates the
      curve at ``iterations = t - 1``, so step 1 runs at rate 0 and every later step at the rate of
      the step before; present wherever exactly one side runs ``CosineDecay``
      (:func:`_runs_cosine_decay`: also between two TensorFlow sides, a Keras optimizer against a rule
      written out) and a step moves;
    * torch's recursion (known, no mapping): ``LinearLR`` and ``CosineAnnealingLR`` compute each
      rate from the last, within about 1e-14 relative of the closed form over 2,000 steps
      (measured, ``torchref.optimizers``), far below the float64 bound: named in float64 where a
      torch side runs them against ``CosineDecay``.

    Neither under ``torch`` or ``tf`` semantics: both sides then compute the contract's curve
    (``protocol.hyper.cosine_lr``) in closed form.
    """
    opt = spec["optimizer"]
    if (opt.get("schedule") or {}).get("kind") != "warmup_cosine" or plugins_only(opt):
        return []
    fa, fb = a.framework, b.framework
    late = [x for x in (a, b) if _runs_cosine_decay(spec, x, own_schedule)]
    if len(late) != 1:
        if opt["semantics"] != "native" and fa != fb:
            absent.append(f"warmup_cosine one step late in Keras' CosineDecay: semantics {opt['semantics']} computes"
                          " the case's curve on both sides")
        elif opt["semantics"] == "native" and (fa != fb or late):
            absent.append("warmup_cosine one step late in Keras' CosineDecay: " + (
                "both sides run it" if late else
                f"neither side runs it ({', '.join(x.name for x in (a, b) if x.name in own_schedule)} computes its own rate)"))
        return []
    if not moves:
        absent.append("warmup_cosine one step late in Keras' CosineDecay: no step moves the parameters")
        return []
    other = b if late[0] is a else a
    k, d = opt["schedule"]["warmup_steps"], opt["schedule"]["decay_steps"]
    against = ("torch's SequentialLR(LinearLR, CosineAnnealingLR) runs the case's rate"
               if other.framework == "torch" and other.name not in own_schedule else
               f"{other.name} computes its own rate (a rule written out: the case's curve)")
    out = [_diff(
        "warmup_cosine one step late in Keras' CosineDecay: it reads iterations (0 at the first update), so"
        f" step t runs at the case's rate of step t - 1 (step 1 at 0, lr first at step {k + 1}, min_lr from step"
        f" {k + d + 1}); {against}", mapping="optimizer")]
    if spec["dtype"] == "float64" and other.framework == "torch" and other.name not in own_schedule:
        out.append(_diff(
            "torch's LinearLR and CosineAnnealingLR are recursive (each rate from the last): within about 1e-14"
            " relative of the closed-form curve over 2,000 steps, below the float64 bound", expected=False))
    return out


#: Keras 3.15 in a float64 run, measured bit for bit (``tests/test_keras_rounding.py``): which
#: hyperparameters pass through float32. ``learning_rate`` (and its use in weight decay) lives in
#: a variable of ``keras.config.floatx()`` at the optimizer's construction; ``ops.cast(python_float,
#: float64)`` goes through float32 for SGD's momentum, ``weight_decay``, Adagrad's initial
#: accumulator and the betas inside Adam's bias correction; ``1 - beta``, ``epsilon`` and RMSprop's
#: ``rho`` and ``momentum`` are weakly typed Python floats and stay exact; a schedule computes its
#: rate in float32.
KERAS_ROUNDED = {
    "sgd": ("momentum", "weight_decay"), "momentum": ("momentum", "weight_decay"),
    "nesterov": ("momentum", "weight_decay"), "adam": ("beta1", "beta2", "weight_decay"),
    "amsgrad": ("beta1", "beta2", "weight_decay"), "adamw": ("beta1", "beta2", "weight_decay"),
    "rmsprop": ("weight_decay",), "adagrad": ("initial_accumulator", "weight_decay"),
}
#: the values of ``optimizer.keras_rounding`` (contract.optimizer): what a Keras optimizer held in float32
KERAS_ROUNDING = ("none", "floatx_float32", "floatx_float64")


def _keras_rounded(spec: dict[str, Any], rounding: str = "floatx_float32") -> str:
    """Which of the case's hyperparameters a Keras optimizer holding ``rounding`` changes by storing them in float32.

    ``""`` when none changes (``rounding`` ``none``, or every such value exact in float32).
    """
    if rounding not in ("floatx_float32", "floatx_float64"):
        return ""
    opt = spec["optimizer"]
    moved = [k for k in KERAS_ROUNDED.get(opt["name"], ())
             if k in opt and isinstance(opt[k], float) and opt[k] != 0 and not _f32_exact(opt[k])
             and (k != "weight_decay" or decays_any(spec))]
    if rounding == "floatx_float32" and not all(_f32_exact(r) for r in _rates(spec)):
        moved.insert(0, "learning_rate")
    return ", ".join(moved)




def mapping_changes(kind: str, spec: dict[str, Any], side: Impl, other: Impl,
                    keras_rounding: str | None = None, own: Collection[str] = (),
                    own_schedule: Collection[str] = ()) -> dict[str, Any] | None:
    """Case changes that make ``side`` compute what ``other`` computes for one :class:`Difference`.

    ``None`` when ``side`` cannot: the change is a field of the case only the tool's own
    implementations read (a plugin is asked for a mapped value only by the session, and only where its
    stand-in is no equivalent run: ``session.judge_pair``, "on the plugin itself"), and the
    structural mappings (weighting, clipping, combine, batch norm) apply to the side that
    splits the batch. ``keras_rounding``: what ``other``'s Keras optimizer held in float32
    when ``side`` is mapped onto a TensorFlow side (``contract.optimizer``'s
    ``keras_rounding``; ``None``: ``other`` is a built-in, whose Keras optimizers are made with
    floatx float32). ``own``: the plugins whose rule is not their framework's class (:func:`predict`'s):
    a torch one among them is mapped onto as Keras' rule with exact numbers, never as torch's class.
    ``own_schedule``: the plugins whose learning rate is their code's (:func:`predict`'s), which run no
    ``CosineDecay``.
    """
    side, other = engine(side), engine(other)
    par = spec["parallel"]
    parallel_side = side.parallel and not other.parallel
    fs, fo = side.framework, other.framework
    if kind == "optimizer":
        if spec["optimizer"]["semantics"] == "tf":
            # both sides run Keras' rule: only what each holds in float32 can differ (``_held``)
            return {"optimizer.semantics": "tf", "optimizer.keras_rounding": keras_rounding or _held(other, {}, spec)}
        if fo == "torch" and other.name not in own:
            return None if fs == "torch" else {"optimizer.semantics": "torch"}
        if other.optimizer_family == "tf.compat.v1" and spec["optimizer"]["name"] not in ("sgd", "momentum"):
            return None  # tf.compat.v1's Adam, RMSprop, Adagrad are not Keras' rules
        # Keras' rule, holding in float32 what the other side's Keras optimizer holds (a TensorFlow
        # side without one: Keras' rule with exact numbers, as the case's "native" says)
        rounding = keras_rounding or ("floatx_float32" if _builtin_keras(other) else "none")
        cosine = (spec["optimizer"].get("schedule") or {}).get("kind") == "warmup_cosine"
        if (cosine and spec["optimizer"]["semantics"] == "native" and _builtin_keras(side) and not _builtin_keras(other)
                and _runs_cosine_decay(spec, other, {*own, *own_schedule})):
            # a Keras built-in under native runs Keras' CosineDecay, a step late; under semantics tf it runs the
            # case's curve. Against a side that runs CosineDecay too (a plugin's own Keras optimizer) the mapping
            # would put a lateness in that neither had; against one whose rate is the curve (a rule written out,
            # own_schedule) the lateness is predicted by name (_schedule_differences) and this maps it away
            return None
        if rounding != "none" and cosine:
            # Keras' CosineDecay computes cos in TensorFlow's float32 kernel, which is not correctly
            # rounded (protocol.hyper.keras_cosine_lr): no other side reproduces its rates bit for bit
            return None
        return {"optimizer.semantics": "tf", "optimizer.keras_rounding": rounding}
    if kind == "weighting" and parallel_side:
        return {"parallel.weighting": "by_size"}
    if kind == "sum_weighting" and parallel_side:  # the devices' sums added, not averaged: the full-batch sum
        return {"parallel.weighting": "sum"}
    if kind == "clip" and parallel_side:
        return {"parallel.clip": {**par["clip"], "where": "after_combine"}}
    if kind == "combine" and parallel_side:
        return {"parallel.combine": "grad_mean", "parallel.period": ..., "parallel.staleness": ...,
                "parallel.order_seed": ...}
    if kind == "batch_norm" and parallel_side:
        return {"parallel.batch_norm": "sync"}
    if kind == "micro_batches" and parallel_side:  # device r's micro-batch j: rows of one device's micro-batch j
        return {"parallel.shard": "strided"}
    if kind == "bn_semantics" and fs != fo:
        if par.get("batch_norm", "local") == "sync" and spec["dtype"] != "float64" and fo == "tf":
            # Keras' one-pass sync statistics are ill-conditioned: two sides computing them with different
            # summation orders still differ by about (mean/std)^2 u; only the merge is reproducible
            return None
        return {f"model.layers.{'.'.join(map(str, path))}.semantics": fo
                for path, layer in nested_layers(spec["model"]["layers"])
                if layer["type"] == "batch_norm" and layer["semantics"] == "native"}
    if kind == "attention_semantics" and fs != fo:
        return {f"model.layers.{path}.semantics": fo for path, _ in native_attention_scales(spec)}
    if kind == "gelu_semantics" and fs != fo:
        return {f"model.layers.{path}.semantics": fo for path in native_gelus(spec["model"]["layers"])}
    if kind == "bias_semantics" and fs == "tf" and fo == "torch":
        return {f"model.layers.{'.'.join(map(str, path))}.semantics": "torch"
                for path, layer in nested_layers(spec["model"]["layers"])
                if keras_adds_bias(layer)}
    if kind == "embedding_gradient":
        return tokens.embedding_mapping(spec, *_tf_builtin(side))
    if kind == "loss_semantics" and _loss_rule(spec, side) != _loss_rule(spec, other):
        return {"model.loss_semantics": _loss_rule(spec, other)}
    return None
