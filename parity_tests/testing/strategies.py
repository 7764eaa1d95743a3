"""Public hypothesis strategies for parity cases.

Usable by anyone testing their own set-ups::

    from hypothesis import given
    from parity_tests.testing.strategies import dense_cases

    @given(dense_cases(devices=device_counts(2, 4), dtypes=["float64"]))
    def test_my_property(case): ...

Every strategy is a plain function returning a ``SearchStrategy``; its
arguments are checked up front, and a bad one raises ``InvalidArgument``
naming the value. Cases are built through the same validation as
``case.json`` files (``parity_tests.contract.case.case_from_dict``), with data and
initial weights drawn in numpy from drawn seeds, so a shrunk failure is small
and replays exactly (``parity_tests.contract.case.write_case``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from parity_tests.contract.case import Case, case_from_dict
from parity_tests.contract.model import ACTIVATIONS, LOSSES
from parity_tests.contract.optimizer import SEMANTICS
from parity_tests.contract.parallel import COMBINES, LOCAL_COMBINES, MAX_DEVICES, SHARDS, WEIGHTINGS
from parity_tests.protocol.errors import TfparError

#: the weightings drawn by default: ``sum`` (with a sum reduction, the judge's mapping of one) only when asked
DRAWN_WEIGHTINGS = ("equal", "by_size")

__all__ = [
    "device_counts",
    "widths",
    "activations",
    "dense_layer_lists",
    "input_shapes",
    "global_batches",
    "optimizers",
    "dtypes",
    "parallel_settings",
    "init_specs",
    "dense_cases",
    "implementations",
    "NESTED_VOCABULARY",
    "nested_layer_lists",
    "nested_cases",
    "nested_token_cases",
]

_OPTIMIZERS = ("sgd", "momentum", "adam")


def _int_arg(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name}={value!r}: expected an integer in [{lo}, {hi}]")
    return value


def _subset(name: str, values: Sequence[str], allowed: Sequence[str]) -> list[str]:
    values = [values] if isinstance(values, str) else list(values)
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise InvalidArgument(f"{name}={values!r}: expected a non-empty list drawn from {list(allowed)}")
    return values


def _range(name: str, lo: int, hi: int, floor: int, ceil: int) -> tuple[int, int]:
    _int_arg(f"min_{name}", lo, floor, ceil)
    _int_arg(f"max_{name}", hi, floor, ceil)
    if lo > hi:
        raise InvalidArgument(f"min_{name}={lo} > max_{name}={hi}")
    return lo, hi


def device_counts(min_value: int = 1, max_value: int = 8, *, check_machine: bool = False) -> st.SearchStrategy[int]:
    """Device counts N in ``[min_value, max_value]`` (at most 64).

    Past 8 (``device_counts(1, 64)``) a case runs 64 TensorFlow towers and a
    64-rank torch pool (about 270 MiB a rank; start-up about 3 CPU-seconds a
    rank, see ``docs/large-world.md``). ``check_machine=True`` checks now, before
    any example runs, that this process can make ``max_value`` of both: it asks
    TensorFlow for that many towers if it has not started yet, and raises
    ``InvalidArgument`` with one line saying why where it cannot (TensorFlow
    already started with fewer devices, or too little memory for the ranks).
    """
    lo, hi = _range("value", min_value, max_value, 1, MAX_DEVICES)
    if check_machine:
        _check_machine(hi)
    return st.integers(lo, hi)


def _check_machine(n: int) -> None:
    """``InvalidArgument`` naming why this process cannot make ``n`` towers or ``n`` torch ranks."""
    import sys

    from parity_tests.protocol.errors import CaseError
    from parity_tests.running.backends import check_torch_ranks, reserve_tf_devices, tf_device_count

    reserve_tf_devices(n)  # enough towers whenever TensorFlow starts after this
    if "tensorflow" in sys.modules and (have := tf_device_count()) < n:  # started: its devices are fixed
        raise InvalidArgument(f"device_counts(max_value={n}): this process has {have} TensorFlow tower devices"
                              f" (TensorFlow fixed them when it started; set TFPAR_DEVICES={n} before it starts)")
    try:
        check_torch_ranks(n)
    except CaseError as e:
        raise InvalidArgument(f"device_counts(max_value={n}): {e}") from None


def implementations(names: Sequence[str], *, min_size: int = 2) -> st.SearchStrategy[list[str]]:
    """Lists of implementation names to compare, the first being the reference.

    ``names``: built-ins, plugins (``file.py:fn``, ``module:fn``), installed names or
    ``recorded:`` runs; each is resolved now (by the registry), so a misspelt plugin
    fails here with the field named, not in the middle of a search. The first name
    of ``names`` is always drawn first (the reference); the others are a subset.
    """
    from parity_tests.running.registry import resolve

    names = list(names)
    if len(names) < min_size or len(set(names)) != len(names):
        raise InvalidArgument(f"names must hold at least {min_size} distinct implementation names, got {names!r}")
    for name in names:
        try:
            resolve(name, "names")
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    ref, others = names[0], names[1:]
    return st.lists(st.sampled_from(others), min_size=min_size - 1, max_size=len(others), unique=True).map(
        lambda picked: [ref, *sorted(picked, key=others.index)])


def widths(min_value: int = 1, max_value: int = 16) -> st.SearchStrategy[int]:
    """Layer widths (dense ``units``)."""
    lo, hi = _range("value", min_value, max_value, 1, 4096)
    return st.integers(lo, hi)


def activations(allowed: Sequence[str] = ACTIVATIONS) -> st.SearchStrategy[str]:
    """Activation names among ``allowed``."""
    return st.sampled_from(_subset("allowed", allowed, ACTIVATIONS))


def dense_layer_lists(*, min_layers: int = 1, max_layers: int = 3, max_width: int = 16, outputs: int = 1,
                      allowed_activations: Sequence[str] = ACTIVATIONS) -> st.SearchStrategy[list[dict]]:
    """Lists of dense layers ending in ``outputs`` units with no activation (logits / regression)."""
    lo, hi = _range("layers", min_layers, max_layers, 1, 16)
    _int_arg("outputs", outputs, 1, 4096)
    hidden = st.builds(
        lambda u, a, b: {"type": "dense", "units": u, "activation": a, "use_bias": b},
        widths(1, max_width), activations(allowed_activations), st.booleans(),
    )
    last = st.builds(lambda b: {"type": "dense", "units": outputs, "activation": "none", "use_bias": b}, st.booleans())
    return st.tuples(st.lists(hidden, min_size=lo - 1, max_size=hi - 1), last).map(lambda t: [*t[0], t[1]])


def input_shapes(min_features: int = 1, max_features: int = 8) -> st.SearchStrategy[list[int]]:
    """1-D input shapes ``[d]``."""
    lo, hi = _range("features", min_features, max_features, 1, 4096)
    return st.integers(lo, hi).map(lambda d: [d])


def global_batches(devices: int, *, max_value: int = 48, divisible: bool | None = None) -> st.SearchStrategy[int]:
    """Global batch sizes >= ``devices``; ``divisible=True`` only multiples of it, ``False`` only non-multiples."""
    _int_arg("devices", devices, 1, MAX_DEVICES)
    _int_arg("max_value", max_value, devices, 1_000_000)
    values = st.integers(devices, max_value)
    if divisible is True:
        return st.integers(1, max_value // devices).map(lambda k: k * devices)
    if divisible is False:
        if devices == 1 or max_value <= devices:
            raise InvalidArgument(f"devices={devices}, max_value={max_value}: no batch size that does not divide")
        return values.filter(lambda b: b % devices != 0)
    return values


def optimizers(*, names: Sequence[str] = _OPTIMIZERS, semantics: Sequence[str] = ("torch", "tf")) -> st.SearchStrategy[dict]:
    """Optimizer sections with hyperparameters in ranges where training is stable for a few steps."""
    names = _subset("names", names, _OPTIMIZERS)
    sems = _subset("semantics", semantics, SEMANTICS)

    @st.composite
    def build(draw):
        name = draw(st.sampled_from(names))
        out: dict[str, Any] = {"name": name, "semantics": draw(st.sampled_from(sems)),
                               "lr": draw(st.sampled_from([1e-3, 1e-2, 5e-2, 0.1]))}
        if name == "momentum":
            out["momentum"] = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]))
        if name == "adam":
            out["beta1"] = draw(st.sampled_from([0.0, 0.9]))
            out["beta2"] = draw(st.sampled_from([0.9, 0.999]))
            out["epsilon"] = draw(st.sampled_from([1e-8, 1e-7, 1e-3]))
        return out

    return build()


def dtypes(allowed: Sequence[str] = ("float32", "float64")) -> st.SearchStrategy[str]:
    """``float32`` / ``float64``."""
    return st.sampled_from(_subset("allowed", allowed, ("float32", "float64")))


def parallel_settings(devices: int, *, combines: Sequence[str] = COMBINES, shards: Sequence[str] = SHARDS,
                      weightings: Sequence[str] = DRAWN_WEIGHTINGS) -> st.SearchStrategy[dict]:
    """``parallel`` sections for ``devices`` devices (``sum`` weighting is drawn only with ``grad_mean``/``loss_mean``)."""
    _int_arg("devices", devices, 1, MAX_DEVICES)
    return st.builds(
        lambda c, s, w: {"devices": devices, "combine": c, "shard": s,
                         "weighting": "equal" if w == "sum" and c in LOCAL_COMBINES else w},
        st.sampled_from(_subset("combines", combines, COMBINES)),
        st.sampled_from(_subset("shards", shards, SHARDS)),
        st.sampled_from(_subset("weightings", weightings, WEIGHTINGS)),
    )


def init_specs() -> st.SearchStrategy[dict]:
    """Seeded initial-weight draws (``normal`` with a small stddev, or ``glorot_uniform``)."""
    return st.one_of(
        st.builds(lambda s, sd: {"seed": s, "kind": "normal", "stddev": sd}, st.integers(0, 2**16), st.sampled_from([0.1, 0.5])),
        st.builds(lambda s: {"seed": s, "kind": "glorot_uniform"}, st.integers(0, 2**16)),
    )


def dense_cases(
    *,
    devices: st.SearchStrategy[int] | None = None,
    dtypes: Sequence[str] = ("float64",),
    losses: Sequence[str] = LOSSES,
    reductions: Sequence[str] = ("mean",),
    combines: Sequence[str] = COMBINES,
    shards: Sequence[str] = SHARDS,
    weightings: Sequence[str] = DRAWN_WEIGHTINGS,
    optimizer_names: Sequence[str] = _OPTIMIZERS,
    semantics: Sequence[str] = ("torch", "tf"),
    even_shards: bool | None = None,
    max_batch: int = 48,
    max_steps: int = 3,
) -> st.SearchStrategy[Case]:
    """Validated dense-model cases: layer lists, widths, batches (uneven ones included), device
    counts, sharding, weighting, optimizers, dtypes, data and initial weights.

    ``even_shards=True`` draws only global batches that divide by the device count,
    ``False`` only ones that do not (device counts >= 2), ``None`` either.
    """
    devices = devices if devices is not None else device_counts()
    dts = _subset("dtypes", dtypes, ("float32", "float64"))
    losses = _subset("losses", losses, LOSSES)
    reductions = _subset("reductions", reductions, ("mean", "sum"))
    _int_arg("max_steps", max_steps, 1, 1000)
    _int_arg("max_batch", max_batch, 2, 100_000)
    if not isinstance(devices, st.SearchStrategy):
        raise InvalidArgument(f"devices={devices!r}: expected a SearchStrategy of ints, e.g. device_counts(1, 8)")

    @st.composite
    def build(draw) -> Case:
        n = draw(devices.filter(lambda k: k <= max_batch and not (even_shards is False and (k == 1 or k >= max_batch))))
        loss = draw(st.sampled_from(losses))
        outputs = draw(st.integers(2, 4)) if loss == "softmax_ce" else draw(st.integers(1, 3))
        raw = {
            "schema": "parity-case/1",
            "name": "generated",
            "dtype": draw(st.sampled_from(dts)),
            "model": {
                "input_shape": draw(input_shapes(1, 6)),
                "layers": draw(dense_layer_lists(max_layers=3, max_width=12, outputs=outputs)),
                "loss": loss,
                "reduction": draw(st.sampled_from(reductions)),
            },
            "init": draw(init_specs()),
            "data": {"generator": "gaussian", "seed": draw(st.integers(0, 2**16)),
                     "global_batch": draw(global_batches(n, max_value=max_batch, divisible=even_shards))},
            "optimizer": draw(optimizers(names=optimizer_names, semantics=semantics)),
            "parallel": draw(parallel_settings(n, combines=combines, shards=shards, weightings=weightings)),
            "steps": draw(st.integers(1, max_steps)),
        }
        if raw["parallel"]["weighting"] == "sum" and raw["model"]["reduction"] != "sum":
            raw["parallel"]["weighting"] = "equal"  # sum adds the devices' sums: with a mean reduction it is refused
        return case_from_dict(raw)

    return build()


# -- nested architectures (docs/case-format.md) -----------------------------------------------------------------
#
# A layer entry draws one layer for an input of ``shape`` (per example), or returns ``None`` where it does not
# apply. ``keep``: the layer must give back ``shape`` (inside a residual body without a shortcut, and a repeat's
# body, whose copies chain); ``depth``: how many nesting layers hold it. An entry decides whether it applies
# before its first draw (the list only picks among entries that apply, so a shrunk network carries no choices
# of entries that did not). Adding a layer type to the drawn vocabulary is one entry in NESTED_VOCABULARY.

Shape = tuple[int, ...]
LayerDraw = Callable[[Callable, Shape, bool, int], "dict | None"]
_MAX_DEPTH = 2
_NESTING = ("residual", "repeat")  # the entries that hold layer lists


def _gelu_mapped(draw: Callable, fn: str) -> dict:
    """A GELU's ``semantics`` mapped (``tf`` or ``torch``): both sides then use one convention's constants, where
    ``native`` is a predicted float64 difference (docs/layers.md)."""
    return {"semantics": draw(st.sampled_from(["torch", "tf"]))} if fn in ("gelu", "gelu_tanh") else {}


def _draw_dense(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if not shape:
        return None
    act = draw(st.sampled_from(["none", "relu", "tanh", "gelu", "silu"]))
    units = shape[-1] if keep else draw(st.integers(1, 6))
    return {"type": "dense", "units": units, "activation": act, **_gelu_mapped(draw, act)}


def _draw_layer_norm(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if not shape:
        return None
    return {"type": "layer_norm", "epsilon": draw(st.sampled_from([1e-5, 1e-3])),
            "center": draw(st.booleans()), "scale": draw(st.booleans())}


def _draw_rms_norm(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    return {"type": "rms_norm", "epsilon": draw(st.sampled_from([1e-6, 1e-3]))} if shape else None


def _draw_activation(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if not shape:
        return None
    fn = draw(st.sampled_from(["relu", "tanh", "sigmoid", "gelu", "gelu_tanh", "silu", "softmax"]))
    return {"type": "activation", "fn": fn, **_gelu_mapped(draw, fn)}


def _draw_conv2d(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if len(shape) != 3:
        return None
    k = draw(st.integers(1, min(3, shape[0], shape[1])))
    if keep:
        return {"type": "conv2d", "filters": shape[2], "kernel_size": k, "padding": "same"}
    return {"type": "conv2d", "filters": draw(st.integers(1, 4)), "kernel_size": k, "strides": draw(st.integers(1, 2)),
            "padding": draw(st.sampled_from(["valid", "same"])), "activation": draw(st.sampled_from(["none", "relu"]))}


def _draw_depthwise_conv2d(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if len(shape) != 3:
        return None
    k = draw(st.integers(1, min(3, shape[0], shape[1])))
    if keep:
        return {"type": "depthwise_conv2d", "kernel_size": k, "padding": "same"}
    return {"type": "depthwise_conv2d", "kernel_size": k, "strides": draw(st.integers(1, 2)),
            "padding": draw(st.sampled_from(["valid", "same"])), "depth_multiplier": draw(st.integers(1, 2))}


def _draw_pool(kind: str) -> LayerDraw:
    def entry(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
        if len(shape) != 3 or keep or min(shape[0], shape[1]) < 2:
            return None
        out = {"type": kind, "pool_size": 2, "padding": draw(st.sampled_from(["valid", "same"])),
               "strides": draw(st.integers(1, 2))}
        if kind == "avg_pool2d":
            out["count_padding"] = draw(st.booleans())
        return out

    return entry


def _draw_global_avg_pool2d(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    return {"type": "global_avg_pool2d"} if len(shape) == 3 and not keep else None


def _draw_channel_pad(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if not shape or keep:
        return None
    return {"type": "channel_pad", "before": draw(st.integers(0, 2)), "after": draw(st.integers(1, 2))}


def _draw_reshape(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    """To tokens ``[T, D]`` or a vector ``[-1]`` (the values per example, channels-last order)."""
    if not shape or keep:
        return None
    n = math.prod(shape)
    targets = [[-1]] + [[t, -1] for t in range(2, n) if n % t == 0]
    return {"type": "reshape", "shape": draw(st.sampled_from(targets))}


def _draw_position_embedding(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    return {"type": "position_embedding", "length": shape[0] + draw(st.integers(0, 2))} if len(shape) == 2 else None


def _draw_class_token(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    return {"type": "class_token"} if len(shape) == 2 and not keep else None


def _draw_take_token(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    if len(shape) != 2 or keep:
        return None
    return {"type": "take_token", "index": draw(st.integers(0, shape[0] - 1))}


def _draw_attention(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    """Self-attention on tokens ``[T, D]`` (keeps the shape); the scale's convention mapped (``semantics``), as
    float64 ``native`` rounds ``1/sqrt(key_dim)`` through float32 on TensorFlow's side (docs/layers.md)."""
    if len(shape) != 2:
        return None
    return {"type": "attention", "num_heads": draw(st.integers(1, 2)), "key_dim": draw(st.integers(1, 3)),
            "value_dim": draw(st.integers(1, 3)), "use_bias": draw(st.booleans()), "causal": draw(st.booleans()),
            "dropout": draw(st.sampled_from([0.0, 0.25])), "semantics": draw(st.sampled_from(["torch", "tf"]))}


def _draw_residual(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    """``act(body(x) + shortcut(x))``: a shape-keeping body with the identity, or a body that widens the last
    axis with a projection (``dense``) or zero channels (``channel_pad``) as the shortcut."""
    if not shape or depth >= _MAX_DEPTH:
        return None
    act = draw(st.sampled_from(["none", "relu"]))
    if keep or not draw(st.booleans()):
        body, _ = draw(_layer_lists(shape, keep=True, depth=depth + 1, min_size=1, max_size=2))
        return {"type": "residual", "body": body, "activation": act}
    width = shape[-1] + draw(st.integers(1, 2))
    body = [{"type": "dense", "units": width}]
    shortcut = draw(st.sampled_from([[{"type": "dense", "units": width}],
                                     [{"type": "channel_pad", "before": 0, "after": width - shape[-1]}]]))
    return {"type": "residual", "body": body, "shortcut": shortcut, "activation": act}


def _draw_repeat(draw: Callable, shape: Shape, keep: bool, depth: int) -> dict | None:
    """``count`` independent copies of a shape-keeping body (``<i>.<r>.<j>.*``)."""
    if not shape or depth >= _MAX_DEPTH:
        return None
    body, _ = draw(_layer_lists(shape, keep=True, depth=depth + 1, min_size=1, max_size=2))
    return {"type": "repeat", "count": draw(st.integers(1, 3)), "body": body}


#: the drawn vocabulary, simplest first (hypothesis shrinks a choice towards the first entry that applies)
NESTED_VOCABULARY: dict[str, LayerDraw] = {
    "dense": _draw_dense,
    "layer_norm": _draw_layer_norm,
    "rms_norm": _draw_rms_norm,
    "activation": _draw_activation,
    "residual": _draw_residual,
    "repeat": _draw_repeat,
    "conv2d": _draw_conv2d,
    "depthwise_conv2d": _draw_depthwise_conv2d,
    "max_pool2d": _draw_pool("max_pool2d"),
    "avg_pool2d": _draw_pool("avg_pool2d"),
    "global_avg_pool2d": _draw_global_avg_pool2d,
    "channel_pad": _draw_channel_pad,
    "reshape": _draw_reshape,
    "position_embedding": _draw_position_embedding,
    "class_token": _draw_class_token,
    "take_token": _draw_take_token,
    "attention": _draw_attention,
}


class _Draws(TfparError):
    """Raised by :func:`_applies`'s draw: the entry reached its first draw, so it applies."""


def _applies(kind: str, shape: Shape, keep: bool, depth: int) -> bool:
    """Whether vocabulary entry ``kind`` gives a layer for ``shape`` (an entry decides before its first draw)."""
    def probe(strategy: Any) -> Any:
        raise _Draws

    try:
        return NESTED_VOCABULARY[kind](probe, shape, keep, depth) is not None
    except _Draws:
        return True


@st.composite
def _one_layer(draw: Callable, shape: Shape, keep: bool, depth: int, names: tuple[str, ...]) -> dict:
    """One layer among the entries of ``names`` that fit ``shape``: a nesting layer half the time (shrinking
    towards none), else any other. One strategy for every depth, so that hypothesis' shrinker can put a
    layer drawn inside a block in the block's place (its pass to a descendant of the same strategy)."""
    fits = [k for k in names if _applies(k, shape, keep, depth)]
    nest, other = [k for k in fits if k in _NESTING], [k for k in fits if k not in _NESTING]
    pool = nest if nest and (not other or draw(st.booleans())) else other
    return NESTED_VOCABULARY[draw(st.sampled_from(pool))](draw, shape, keep, depth)


def _layer_lists(shape: Shape, *, keep: bool = False, depth: int = 0, min_size: int = 1, max_size: int = 3,
                 vocabulary: Sequence[str] | None = None) -> st.SearchStrategy[tuple[list[dict], Shape]]:
    """``(layers, output shape)``: a list of drawn layers on inputs of ``shape``, each fitting the shape before it."""
    from parity_tests.contract.model import validate_model

    names = list(NESTED_VOCABULARY) if vocabulary is None else list(vocabulary)

    @st.composite
    def build(draw) -> tuple[list[dict], Shape]:
        layers: list[dict] = []
        h = tuple(shape)
        # "another layer?" after every layer past min_size, asked at max_size too (then ignored, so the shrinker
        # sets it to no): a layer and the answer after it are deleted together and what follows still lines up
        while not (len(layers) >= min_size and not draw(st.booleans())) and len(layers) < max_size:
            drawn = draw(_one_layer(h, keep, depth, tuple(names)))
            layers.append(drawn)
            # the shape it gives, by the case's own validation (which fills in the fields left to defaults)
            h = tuple(validate_model({"input_shape": list(h), "layers": [drawn], "loss": "mse"})[2])
        return layers, h

    return build()


def nested_layer_lists(input_shape: Sequence[int], *, max_layers: int = 3, outputs: int = 1,
                       vocabulary: Sequence[str] | None = None) -> st.SearchStrategy[list[dict]]:
    """Layer lists for inputs of ``input_shape`` drawn from :data:`NESTED_VOCABULARY` (residuals inside repeats
    inside residuals, at most two deep), ending in ``flatten`` where needed and ``dense`` to ``outputs`` units.

    ``vocabulary``: the layer types drawn (default: all; ``dense`` is always among them, so that every shape
    has a layer that applies). Shapes always fit: each entry draws for the shape the layers before it give.
    """
    _int_arg("max_layers", max_layers, 1, 16)
    _int_arg("outputs", outputs, 1, 4096)
    names = list(NESTED_VOCABULARY) if vocabulary is None else _subset("vocabulary", vocabulary, list(NESTED_VOCABULARY))
    if "dense" not in names:
        names = ["dense", *names]

    def head(drawn: tuple[list[dict], Shape]) -> list[dict]:
        layers, h = drawn
        return [*layers, *([{"type": "flatten"}] if len(h) > 1 else []), {"type": "dense", "units": outputs}]

    return _layer_lists(tuple(input_shape), min_size=1, max_size=max_layers, vocabulary=names).map(head)


def nested_cases(*, devices: st.SearchStrategy[int] | None = None, dtypes: Sequence[str] = ("float64",),
                 max_layers: int = 3, max_batch: int = 16, max_steps: int = 2,
                 vocabulary: Sequence[str] | None = None,
                 shapes: st.SearchStrategy[list[int]] | None = None) -> st.SearchStrategy[Case]:
    """Validated cases whose models are drawn nested architectures (:func:`nested_layer_lists`) on a vector
    ``[d]``, tokens ``[T, D]`` or an image ``[H, W, C]``, small enough that a comparison takes about a second:
    mse on gaussian data, SGD/momentum/Adam with ``tf`` or ``torch`` semantics (both sides one rule), GELUs
    mapped, ``grad_mean`` over ``devices`` (default 1..8) with contiguous shards weighted by size.
    ``shapes``: the input shapes to draw (default: vectors, tokens and images, in that order)."""
    devices = devices if devices is not None else device_counts()
    dts = _subset("dtypes", dtypes, ("float32", "float64"))
    _int_arg("max_steps", max_steps, 1, 1000)
    _int_arg("max_batch", max_batch, 2, 100_000)
    if not isinstance(devices, st.SearchStrategy):
        raise InvalidArgument(f"devices={devices!r}: expected a SearchStrategy of ints, e.g. device_counts(1, 8)")
    if shapes is None:
        shapes = st.one_of(st.integers(2, 6).map(lambda d: [d]),
                           st.tuples(st.integers(2, 4), st.integers(2, 4)).map(list),
                           st.tuples(st.integers(2, 4), st.integers(2, 4), st.integers(1, 3)).map(list))
    elif not isinstance(shapes, st.SearchStrategy):
        raise InvalidArgument(f"shapes={shapes!r}: expected a SearchStrategy of input shapes, e.g. st.just([4])")

    @st.composite
    def build(draw) -> Case:
        n = draw(devices.filter(lambda k: k <= max_batch))
        shape = draw(shapes)
        outputs = draw(st.integers(1, 2))
        raw = {
            "schema": "parity-case/1",
            "name": "generated-nested",
            "dtype": draw(st.sampled_from(dts)),
            "model": {"input_shape": shape, "loss": "mse", "reduction": "mean",
                      "layers": draw(nested_layer_lists(shape, max_layers=max_layers, outputs=outputs,
                                                        vocabulary=vocabulary))},
            "init": draw(init_specs()),
            "data": {"generator": "gaussian", "seed": draw(st.integers(0, 2**16)),
                     "global_batch": draw(global_batches(n, max_value=max_batch))},
            "optimizer": draw(optimizers()),
            "parallel": {"devices": n, "combine": "grad_mean", "shard": "contiguous", "weighting": "by_size"},
            "steps": draw(st.integers(1, max_steps)),
        }
        return case_from_dict(raw)

    return build()


def nested_token_cases(*, devices: st.SearchStrategy[int] | None = None, max_layers: int = 2, max_batch: int = 8,
                       max_steps: int = 2, vocabulary: Sequence[str] | None = None) -> st.SearchStrategy[Case]:
    """Validated token models (GPT-like): ``embedding`` (``model.layers[0]``, integer ids ``[T]``), drawn
    shape-keeping blocks on ``[T, D]`` (:data:`NESTED_VOCABULARY`: residuals, repeats, attention, norms, ...),
    then per-token logits, a ``dense`` layer or ``tied_logits`` to the embedding, and per-token ``softmax_ce``
    on the ``tokens`` generator, float64. The embedding's gradient is ``dense`` (mapped: TensorFlow's sparse
    second moment under Adam is a predicted difference) except under plain SGD, where ``native`` and
    ``dense`` train alike."""
    devices = devices if devices is not None else device_counts()
    _int_arg("max_steps", max_steps, 1, 1000)
    _int_arg("max_batch", max_batch, 2, 100_000)
    _int_arg("max_layers", max_layers, 1, 16)
    if not isinstance(devices, st.SearchStrategy):
        raise InvalidArgument(f"devices={devices!r}: expected a SearchStrategy of ints, e.g. device_counts(1, 8)")
    names = list(NESTED_VOCABULARY) if vocabulary is None else _subset("vocabulary", vocabulary, list(NESTED_VOCABULARY))
    names = names if "dense" in names else ["dense", *names]

    @st.composite
    def build(draw) -> Case:
        n = draw(devices.filter(lambda k: k <= max_batch))
        t, v, d = draw(st.integers(2, 4)), draw(st.integers(3, 6)), draw(st.integers(2, 4))
        body, _ = draw(_layer_lists((t, d), keep=True, min_size=1, max_size=max_layers, vocabulary=names))
        head = ({"type": "tied_logits", "embedding": "0"} if draw(st.booleans())
                else {"type": "dense", "units": draw(st.integers(2, v))})
        optimizer = draw(optimizers())
        gradient = draw(st.sampled_from(["native", "dense"])) if optimizer["name"] == "sgd" else "dense"
        raw = {
            "schema": "parity-case/1",
            "name": "generated-tokens",
            "dtype": "float64",
            "model": {"input_shape": [t], "loss": "softmax_ce", "reduction": "mean",
                      "layers": [{"type": "embedding", "input_dim": v, "output_dim": d, "gradient": gradient},
                                 *body, head]},
            "init": draw(init_specs()),
            "data": {"generator": "tokens", "seed": draw(st.integers(0, 2**16)),
                     "global_batch": draw(global_batches(n, max_value=max_batch))},
            "optimizer": optimizer,
            "parallel": {"devices": n, "combine": "grad_mean", "shard": "contiguous", "weighting": "by_size"},
            "steps": draw(st.integers(1, max_steps)),
        }
        return case_from_dict(raw)

    return build()
