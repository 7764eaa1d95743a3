"""The hunt's corpus: which implementations and bugs run which cases, how cases are drawn, and the ground truth.

An *equivalent pair* is two correct implementations (built-ins or the rewrites of
``tf_side.py`` / ``torch_side.py``) of a drawn case; a *bug pair* is a correct
implementation (the reference) and one with a seeded bug (a bug plugin, or a
built-in run on a mutated case: :data:`MUTATIONS`). :func:`pairs` draws both with
hypothesis, with hyperparameters that include edge values (0, 1, tiny, huge).

The ground truth (:func:`truth`) is written down from the construction, never
from the judge's theory (``docs/error-rates.md``, "The ground truth"):

* an equivalent pair whose learning rate is 0 compares nothing (no parameter
  moves): the right verdict is ``inconclusive`` (CONTRACT §8); where the
  parameters barely move (:func:`update_scale` times the steps below what the
  dtype resolves, :data:`STILL`) ``inconclusive`` is right too;
* otherwise the right verdict is ``parity``, or ``expected_difference`` where
  the two compute different updates in exact arithmetic (:func:`differences`:
  the frameworks' native Adam epsilon placement, clip_grad_norm_'s 1e-6, Keras'
  float32 hyperparameters in a float64 run, N devices against one with a sum
  reduction, uneven shards under equal weighting or a per-device clip that is
  reached, mixed-precision rounding of different ops, and a ``warmup_cosine`` run by
  Keras' ``CosineDecay`` on one side only: one step late, step 1 at rate 0, so
  ``expected_difference`` alone is right there, never ``parity``). Where the construction
  says the two compute the same numbers, ``expected_difference`` is wrong too
  (theory named a difference that does not exist, and a real one hides behind
  it). Where both runs overflow the right verdict is ``error`` or ``inconclusive``;
  where every recorded gradient is exactly zero (a dead ReLU network), ``inconclusive``;
* a bug pair is caught only by a verdict that says the code is wrong (``divergence``, or
  ``unexpected_parity``: :meth:`Bug.caught_by`); ``parity`` and ``expected_difference`` (a bug
  hidden behind a predicted difference) are misses, and so are ``inconclusive`` and ``error``
  unless the bug itself makes the run vacuous (issue 35, item 8), or the case does: where nothing moves on
  either side (lr 0, or updates below the dtype, or a dead network: every gradient the correct reference records
  exactly zero), CONTRACT §8 makes every pair ``inconclusive`` whatever the logged loss says, so ``inconclusive``
  is right there (counted apart); where both runs overflow (the correct
  reference too: the case does), ``error`` and ``inconclusive`` are right for a bug as well (counted apart).
  Both runs of an equivalent pair overflowing, the
  right verdict is ``error`` or ``inconclusive``, or ``expected_difference`` where a difference is certain
  (it shows in step 1's loss, computed before any update can overflow). Each bug is drawn only
  on cases where it changes what is computed, by an amount the float64 bound
  resolves (:attr:`Bug.applies`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from parity_tests.contract.case import MIXED_BFLOAT16, Case, case_from_dict
from parity_tests.protocol.errors import CaseError
from parity_tests.testing.strategies import (
    dense_layer_lists,
    init_specs,
    input_shapes,
)
from parity_tests.tests.hunt.schedule import curve

__all__ = ["HERE", "TF", "TORCH", "PROGRAMS", "program", "OK", "LRS", "EPSILONS", "CLIP_NORMS", "ALWAYS", "NEVER", "STILL", "RELATIVE_FLOOR", "Impl", "IMPLS",
           "BY_NAME", "Bug", "BUGS", "BUG_PLUGINS", "MUTATIONS", "Pair", "tf", "torch", "mutant", "register_mutants",
           "mutated_runner", "specs", "pairs", "bug_weights", "behind", "shard_sizes", "update_scale", "differences",
           "cosine", "curve", "rates", "LATE", "MOMENTUM", "WARMUPS", "DECAYS", "FLOORS",
           "truth", "judgement"]

HERE = Path(__file__).resolve().parent
TF = HERE / "tf_side.py"
TORCH = HERE / "torch_side.py"
PROGRAMS = HERE / "programs.py"
OK = ("parity", "expected_difference")

# ---------------------------------------------------------------- drawn values (edges included)

# the first value of each is a usual one: hypothesis draws the first element of sampled_from most often
LRS = (1e-3, 0.0, 1e-7, 0.05, 1.0, 10.0)  # usual, 0, tiny, larger, 1, huge
MOMENTA = (0.9, 0.0, 0.5, 1.0)
BETA1S = (0.9, 0.0, 0.999999)
BETA2S = (0.999, 0.0, 0.9, 0.999999)
EPSILONS = (1e-8, 0.0, 1e-12, 1e-3, 1.0)
CLIP_NORMS = (0.5, 1e-6, 1e6)  # sometimes reached, always, never
ALWAYS, NEVER = CLIP_NORMS[1], CLIP_NORMS[2]
# warmup_cosine (parity_tests/contract/optimizer.py; the contract's smallest warm-up is k = 1: one step to lr); the runs last 1-4 steps
WARMUPS = (2, 1, 3, 6)  # usual, the smallest, about the run, longer than the run (the rate never reaches lr)
DECAYS = (3, 1, 2, 10)  # usual, done in one step (min_lr from step k + 1), two, longer than the run
FLOORS = (0.0, 0.1)  # min_lr as a fraction of lr: decay to 0, to a floor


def shard_sizes(spec: dict) -> list[int]:
    """Rows per device (``np.array_split`` sizes, or strided ``r, r+N, ...``)."""
    b, n = spec["data"]["global_batch"], spec["parallel"]["devices"]
    if spec["parallel"]["shard"] == "strided":
        return [len(range(r, b, n)) for r in range(n)]
    return [len(a) for a in np.array_split(np.arange(b), n)]


def cosine(spec: dict) -> dict | None:
    """The case's ``warmup_cosine`` schedule, ``None`` for a constant rate (the only two the hunt draws)."""
    s = spec["optimizer"].get("schedule") or {"kind": "constant"}
    return s if s["kind"] == "warmup_cosine" else None


def rates(spec: dict, late: bool = False) -> list[float]:
    """The learning rate of each step ``t = 1..steps``: the curve's ``f(t)``, or ``f(t - 1)`` where ``late``
    (Keras' ``CosineDecay`` reads the updates already applied: step 1 at 0); ``lr`` at every step without a schedule."""
    s, lr = cosine(spec), spec["optimizer"]["lr"]
    if s is None:
        return [lr] * spec["steps"]
    return [curve(s, lr, t - 1 if late else t) for t in range(1, spec["steps"] + 1)]


def _uneven(spec: dict) -> bool:
    return len(set(shard_sizes(spec))) > 1


def _clip(spec: dict) -> dict | None:
    return spec["parallel"].get("clip")


@st.composite
def specs(draw, dtypes: tuple[str, ...] = ("float32", "float64", MIXED_BFLOAT16)) -> dict:
    """A raw, valid case dict: a dense model, edge-valued hyperparameters, 1-8 devices, uneven shards."""
    n = draw(st.sampled_from((4, 2, 3, 1, 5, 6, 7, 8)))  # device_counts(1, 8) would draw 1 most often
    loss = draw(st.sampled_from(("sigmoid_ce", "mse", "softmax_ce")))
    outputs = draw(st.integers(2, 4)) if loss == "softmax_ce" else draw(st.integers(1, 3))
    name = draw(st.sampled_from(("sgd", "momentum", "adam")))
    opt: dict[str, Any] = {"name": name, "semantics": draw(st.sampled_from(("native", "tf", "torch"))),
                           "lr": draw(st.sampled_from(LRS))}
    if opt["lr"] > 0 and draw(st.integers(0, 4)) == 0:  # one case in five: the GPT trainers' warm-up + cosine
        opt["schedule"] = {"kind": "warmup_cosine", "warmup_steps": draw(st.sampled_from(WARMUPS)),
                           "decay_steps": draw(st.sampled_from(DECAYS)),
                           "min_lr": draw(st.sampled_from(FLOORS)) * opt["lr"]}
    if name == "momentum":
        opt["momentum"] = draw(st.sampled_from(MOMENTA))
    if name == "adam":
        opt.update(beta1=draw(st.sampled_from(BETA1S)), beta2=draw(st.sampled_from(BETA2S)),
                   epsilon=draw(st.sampled_from(EPSILONS)))
    par: dict[str, Any] = {"devices": n, "combine": draw(st.sampled_from(("grad_mean", "loss_mean"))),
                           "shard": draw(st.sampled_from(("contiguous", "strided"))),
                           "weighting": draw(st.sampled_from(("equal", "by_size")))}
    if draw(st.integers(0, 2)) == 0:  # a third of the cases clip
        where = draw(st.sampled_from(("after_combine", "per_device")))
        par["clip"] = {"global_norm": draw(st.sampled_from(CLIP_NORMS)), "where": where}
        if where == "per_device":
            par["combine"] = "grad_mean"
    raw = {
        "schema": "parity-case/1",
        "name": "hunt",
        "dtype": draw(st.sampled_from(dtypes)),
        "seed": draw(st.integers(0, 2**16)),
        "model": {"input_shape": draw(input_shapes(1, 6)),
                  "layers": draw(dense_layer_lists(max_layers=3, max_width=8, outputs=outputs)),
                  "loss": loss, "reduction": draw(st.sampled_from(("mean", "sum")))},
        "init": draw(init_specs()),
        "data": {"generator": "gaussian", "seed": draw(st.integers(0, 2**16)),
                 "global_batch": draw(st.integers(n, max(3 * n, 12)))},
        "optimizer": opt,
        "parallel": par,
        "steps": draw(st.integers(1, 4)),
    }
    return raw


# ---------------------------------------------------------------- implementations


def tf(fn: str) -> str:
    return f"{TF}:{fn}"


def torch(fn: str) -> str:
    return f"{TORCH}:{fn}"


def program(fn: str) -> str:
    return f"{PROGRAMS}:{fn}"


def _plain(spec: dict) -> bool:
    return spec["dtype"] != MIXED_BFLOAT16


def _fits_keras_fit(spec: dict) -> bool:
    """What ``programs.keras_fit`` honours: ``model.fit`` splits a global batch into equal contiguous slices,
    reduces a mean, clips nothing, and uses Keras' own optimizer classes (``semantics: native``)."""
    par, b, n = spec["parallel"], spec["data"]["global_batch"], spec["parallel"]["devices"]
    return (_plain(spec) and spec["optimizer"]["semantics"] == "native" and spec["model"]["reduction"] == "mean"
            and cosine(spec) is None  # programs.py reads no schedule
            and par.get("clip") is None and par["shard"] == "contiguous" and b % n == 0)


def _fits_keras_fit_float32(spec: dict) -> bool:
    """``_fits_keras_fit`` in a float32 case: ``programs.keras_fit_l2_user``'s float64 run holds Keras' float32
    factor, its port's the exact one, so the two compute the same numbers only in float32."""
    return spec["dtype"] == "float32" and _fits_keras_fit(spec)


def _fits_v1_losses(spec: dict) -> bool:
    """What ``programs.v1_losses`` honours, in float32 cases: ``np.array_split`` clones, each clone's mean loss
    times 1/N (equal weighting, or even shards), no clip, TensorFlow's Adam rule (``tf``/``native``)."""
    par, o = spec["parallel"], spec["optimizer"]
    even = len(set(shard_sizes(spec))) == 1
    return (spec["dtype"] == "float32" and spec["model"]["reduction"] == "mean" and par.get("clip") is None
            and cosine(spec) is None  # programs.py reads no schedule
            and par["shard"] == "contiguous" and (par["weighting"] == "equal" or even)
            and (o["name"] != "adam" or o["semantics"] in ("tf", "native")))


@dataclass(frozen=True)
class Impl:
    """A correct implementation and what it runs.

    Attributes:
        name: the implementation name (a built-in, or ``path:function``).
        label: short, for tables (``tf:add_n``).
        framework: ``tf`` or ``torch``.
        parallel: splits the global batch over devices.
        keras: rounds momentum and Adam's bias-correction betas (and ``lr``, unless ``exact_lr``) to float32
            in a float64 ``native`` run.
        runs: ``runs(spec)``: whether it honours every field of that (validated) case.
        group: what it computes beyond the case: ``"case"`` nothing; ``"l2"`` the case's loss plus the
            programs' own L2 term (``programs.L2``), which no built-in computes; ``"l2_user"`` the same with the
            factor users write (``programs.L2_USER``). Pairs are drawn within a group.
        exact_lr: Keras made under floatx float64 (docs/plugins.md's recipe): ``learning_rate`` a float64 variable.
        fit: ``model.fit`` under ``MirroredStrategy``: each replica's loss scaled by Keras' float32(1/N)
            (``keras/src/losses/loss.py`` ``scale_loss_for_distribution``), so a float64 run's loss and
            gradients are ``float32(1/N) N`` times the exact ones where N is not a power of two.

    A ``warmup_cosine`` case: every Keras optimizer under ``native`` runs Keras' own ``CosineDecay``
    (the TensorFlow built-ins, ``keras_model``), one step late and in float32 (:meth:`late`); every
    other implementation the contract's curve ``f(t)``, the written-out rules of ``tf_side.py``
    included (docs/error-rates.md).
    """

    name: str
    label: str
    framework: str
    parallel: bool
    keras: bool
    runs: Callable[[dict], bool]
    group: str = "case"
    exact_lr: bool = False
    fit: bool = False

    def late(self, spec: dict) -> bool:
        """Whether this run's schedule is Keras' ``CosineDecay`` on ``spec``: step ``t`` at the curve's ``f(t - 1)``."""
        return cosine(spec) is not None and self.keras and spec["optimizer"]["semantics"] == "native"

    def rounds(self, spec: dict) -> bool:
        """Whether this run keeps hyperparameters in float32 although the case is float64."""
        return self.keras and spec["dtype"] == "float64" and spec["optimizer"]["semantics"] == "native"

    def rounded(self, spec: dict) -> set[str]:
        """The hyperparameters this run holds in float32 on ``spec`` (empty where it rounds none)."""
        if not self.rounds(spec):
            return set()
        return {"momentum", "beta1", "beta2"} | (set() if self.exact_lr else {"lr"})


def _any(spec: dict) -> bool:
    return True


IMPLS: list[Impl] = [
    Impl("tf.towers", "tf.towers", "tf", True, True, _any),
    Impl("tf.single", "tf.single", "tf", False, True, _any),
    Impl("torch.ddp", "torch.ddp", "torch", True, False, _any),
    Impl("torch.single", "torch.single", "torch", False, False, _any),
    Impl("tf.mirrored", "tf.mirrored", "tf", True, True, _plain),
    Impl(tf("add_n"), "tf:add_n", "tf", True, False, _plain),
    Impl(tf("stack_mean"), "tf:stack_mean", "tf", True, False, _plain),
    Impl(tf("concat_loss"), "tf:concat_loss", "tf", True, False,
         lambda s: _plain(s) and (_clip(s) is None or _clip(s)["where"] != "per_device")),
    Impl(tf("add_n_nograds"), "tf:add_n_nograds", "tf", True, False, _plain),
    Impl(tf("add_n_f32"), "tf:add_n_f32", "tf", True, False, lambda s: s["dtype"] == "float32"),
    Impl(tf("keras_model"), "tf:keras_model", "tf", True, True,
         lambda s: _plain(s) and s["optimizer"]["semantics"] == "native"),
    Impl(torch("ddp"), "torch:ddp", "torch", True, False, _plain),
    Impl(torch("hand_allreduce"), "torch:hand_allreduce", "torch", True, False, _plain),
    Impl(torch("single"), "torch:single", "torch", False, False, _plain),
    Impl(torch("ddp_f32"), "torch:ddp_f32", "torch", True, False, lambda s: s["dtype"] == "float32"),
    # programs as users write them (issue 35, item 8)
    Impl(program("keras_fit"), "prog:keras_fit", "tf", True, True, _fits_keras_fit, exact_lr=True, fit=True),
    Impl(program("keras_fit_floatx"), "prog:keras_fit_floatx", "tf", True, True, _fits_keras_fit, exact_lr=True,
         fit=True),
    Impl(program("v1_losses"), "prog:v1_losses", "tf", True, False, _fits_v1_losses),
    Impl(program("keras_fit_l2"), "prog:keras_fit_l2", "tf", True, True, _fits_keras_fit, group="l2", exact_lr=True,
         fit=True),
    Impl(torch("ddp_l2"), "torch:ddp_l2", "torch", True, False, _fits_keras_fit, group="l2"),
    # the factor users write (1e-3), which Keras holds as float32(1e-3) in a float64 run: float32 cases only
    Impl(program("keras_fit_l2_user"), "prog:keras_fit_l2_user", "tf", True, True, _fits_keras_fit_float32,
         group="l2_user", exact_lr=True, fit=True),
    Impl(torch("ddp_l2_user"), "torch:ddp_l2_user", "torch", True, False, _fits_keras_fit_float32, group="l2_user"),
]
BY_NAME = {i.name: i for i in IMPLS}


# ---------------------------------------------------------------- bugs


def _n(spec: dict) -> int:
    return spec["parallel"]["devices"]


def _lr(spec: dict) -> float:
    return spec["optimizer"]["lr"]


def _bug_lr(spec: dict) -> float:
    """The smallest rate of steps 2.. under either reading of a ``warmup_cosine`` (``f(t)``, ``f(t - 1)``): what a
    bug's effect scales with at the steps it acts on, wherever it is seeded (0 for a one-step run); ``lr`` else."""
    if cosine(spec) is None:
        return _lr(spec)
    later = rates(spec)[1:] + rates(spec, late=True)[1:]
    return min(later) if later else 0.0


def _scale_matters(spec: dict) -> bool:
    """Whether multiplying every gradient by a constant changes the update.

    Adam is invariant to it but for epsilon (so only a large epsilon makes it show), and a
    clip after the combine that is always reached normalises it away.
    """
    o, c = spec["optimizer"], _clip(spec)
    if o["name"] == "adam" and o["epsilon"] < 1e-3:
        return False
    return not (c is not None and c["where"] == "after_combine" and c["global_norm"] != NEVER)


def update_scale(spec: dict, lr: float | None = None, t: int | None = None, keras_rule: bool = False) -> float:
    """A rough size of one step's change of a parameter element, relative to the parameters (about 0.1 to 1).

    SGD and momentum move by ``lr |g|``: ``|g|`` taken as 1e-2 (a mean loss of these
    models), 1e-6 where a clip after the combine or per device is always reached. Adam
    moves by about ``lr`` whatever the gradient's size, ``lr |g| / eps`` once epsilon
    dominates. ``lr``: the rate to take (default the case's ``lr``; a step's rate under a schedule).

    ``keras_rule`` (with ``t``, the step): Keras' Adam, ``p -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)``,
    is ``lr m_hat / (sqrt(v_hat) + eps / sqrt(1 - b2^t))``: torch's rule with epsilon ``eps / sqrt(1 - b2^t)``,
    1000 ``eps`` at step 1 for ``beta2 = 0.999999`` (the 10,000-pair run's s3-0876/0877: lr 10, eps 1, a clip of
    1e-6, so ``lr |g| / eps = 1e-5`` a step by the torch reading, 1e-8 by Keras' rule, which the two written-out
    Keras rules ran: nothing moved in float32, and ``inconclusive`` was right).
    """
    o, c = spec["optimizer"], _clip(spec)
    lr = o["lr"] if lr is None else lr
    g = 1e-6 if c is not None and c["global_norm"] == ALWAYS else 1e-2
    if o["name"] == "adam":
        eps = o["epsilon"]
        if keras_rule and t is not None and o["beta2"] < 1.0:
            eps = eps / math.sqrt(1.0 - o["beta2"] ** t)
        return lr * min(1.0, g / eps) if eps > 0 else lr
    return lr * g


def keras_rule(spec: dict, i: Impl) -> bool:
    """Whether ``i`` updates by Keras' rule on ``spec``: a TensorFlow side under ``native``, every side under ``tf``
    (the rule :func:`differences` compares)."""
    sem = spec["optimizer"]["semantics"]
    return i.framework == "tf" if sem == "native" else sem == "tf"


def _moves(spec: dict) -> bool:
    """The update is large enough that a bug in it shows above the float64 bound (1e-10) by orders of magnitude."""
    return update_scale(spec, _bug_lr(spec)) >= 1e-6


def _n_gt1(spec: dict) -> bool:
    return _n(spec) > 1


@dataclass(frozen=True)
class Bug:
    """One seeded bug.

    Attributes:
        name: the bug's name (the plugin's function, or the mutation's).
        impl: the implementation that carries it (a bug plugin, or a built-in run on a mutated case).
        base: the correct implementation it is a change of (its support applies).
        applies: ``applies(spec)``: the bug changes what is computed on that case, materially.
        why: one line.
        mutate: for a case-level bug, ``mutate(case) -> case`` (what the built-in ``base`` is run on, as
            the implementation ``impl``: :func:`register_mutants`).
        logs: the bug is in the logged loss only.
        vacuous: the bug itself leaves nothing to compare (no parameter moves): ``inconclusive`` catches it.
    """

    name: str
    impl: str
    base: str
    applies: Callable[[dict], bool]
    why: str
    mutate: Callable[[Case], Case] | None = None
    logs: bool = False
    vacuous: bool = False

    def caught_by(self) -> tuple[str, ...]:
        """The verdicts that say something is wrong with this bug's code (issue 35, item 8): a divergence, or
        unexpected parity (a predicted difference gone: something changed what is computed). ``inconclusive``
        and ``error`` say nothing of the code unless the bug makes the run vacuous; none of these bugs crashes."""
        return ("divergence", "unexpected_parity") + (("inconclusive",) if self.vacuous else ())

    @property
    def label(self) -> str:
        return self.name if self.mutate is None else f"{self.name}@{self.base}"


def _tfbug(name: str, applies: Callable[[dict], bool], why: str, logs: bool = False) -> Bug:
    return Bug(name, tf(name), tf("add_n"), applies, why, logs=logs)


def _torchbug(name: str, applies: Callable[[dict], bool], why: str, base: str = "ddp", logs: bool = False) -> Bug:
    return Bug(name, torch(name), torch(base), applies, why, logs=logs)


def _adam_steps(spec: dict) -> bool:
    """Adam normalises the step: at step 1 with a small epsilon it is lr sign(g), so a changed gradient may not show."""
    o = spec["optimizer"]
    return o["name"] != "adam" or o["epsilon"] >= 1e-3 or spec["steps"] >= 2


def _clip_always_after(spec: dict) -> bool:
    c = _clip(spec)
    return c is not None and c["where"] == "after_combine" and c["global_norm"] == ALWAYS


def _layers(spec: dict) -> list:
    return spec["model"]["layers"]


def _elements_per_device(spec: dict) -> list[int]:
    k = 1 if spec["model"]["loss"] == "softmax_ce" else _layers(spec)[-1]["units"]
    return [s * k for s in shard_sizes(spec)]


def _lr_resolved(spec: dict) -> bool:
    """A learning rate off by 1e-3 moves the parameters by 1e-3 of an update: 100 float64 bounds (1e-10), or,
    in a float32 case, 1e-5 relative (float32's rule holds its float64 runs to about 1e-7 a step)."""
    return update_scale(spec) * 1e-3 >= (1e-8 if spec["dtype"] == "float64" else 1e-5)


BUG_PLUGINS: list[Bug] = [
    _tfbug("grads_summed", lambda s: _n_gt1(s) and _moves(s) and _scale_matters(s), "gradients summed, not averaged"),
    _tfbug("extra_one_over_n", lambda s: _n_gt1(s) and _moves(s) and _scale_matters(s), "the average divided by N again"),
    _tfbug("unshared_towers", lambda s: _n_gt1(s) and _moves(s) and _adam_steps(s),
           "each tower updates its own copy; tower 0's is reported"),
    _tfbug("same_shard", _n_gt1, "every tower reads tower 0's rows"),
    _tfbug("equal_weights_uneven", lambda s: _n_gt1(s) and _uneven(s) and s["parallel"]["weighting"] == "by_size",
           "a plain mean over towers where by_size is asked"),
    _tfbug("clip_per_tower", lambda s: _n_gt1(s) and _moves(s) and _clip_always_after(s),
           "each tower clipped before the combine, where the case clips after"),
    _tfbug("unscoped_loss_collection", _n_gt1, "tower k's loss also sums towers 0..k-1's"),
    _tfbug("extra_update_on_log_steps", lambda s: s["steps"] >= 3 and _moves(s), "every third step applies its update twice"),
    _tfbug("adam_no_bias_correction", lambda s: s["optimizer"]["name"] == "adam" and _moves(s)
           and (s["optimizer"]["beta1"] > 0 or s["optimizer"]["beta2"] > 0), "Adam without bias correction"),
    _tfbug("bias_frozen", lambda s: _moves(s) and any(la["use_bias"] for la in _layers(s)), "biases left out of var_list"),
    _tfbug("half_mse", lambda s: s["model"]["loss"] == "mse", "the 1/2 (y - f)^2 convention"),
    _tfbug("missing_activation", lambda s: len(_layers(s)) >= 2 and _layers(s)[0]["activation"] != "none",
           "the first layer's activation forgotten"),
    _tfbug("last_tower_loss", _n_gt1, "the last tower's loss logged (no grads=)", logs=True),
    _tfbug("tower0_loss", _n_gt1, "tower 0's loss logged (no grads=)", logs=True),
    _tfbug("towers_sum_loss", _n_gt1, "the towers' losses summed in the log (no grads=)", logs=True),
    _tfbug("loss_after_update", _moves, "the loss logged after the update (no grads=)", logs=True),
    _torchbug("loss_times_world_size", lambda s: _n_gt1(s) and _moves(s) and _scale_matters(s)
              and (_clip(s) is None or _clip(s)["where"] != "per_device"), "loss times N before backward"),
    _torchbug("replica_skips_update", lambda s: _n_gt1(s) and _moves(s) and s["steps"] >= 2,
              "the last rank skips step 2's optimizer step"),
    _torchbug("same_shard", _n_gt1, "every rank reads rank 0's rows"),
    _torchbug("by_size_ignored", lambda s: _n_gt1(s) and _uneven(s) and s["parallel"]["weighting"] == "by_size",
              "a plain mean over ranks where by_size is asked"),
    _torchbug("allreduce_no_divide", lambda s: _n_gt1(s) and _moves(s) and _scale_matters(s),
              "the hand all-reduce's / N forgotten", base="hand_allreduce"),
    _torchbug("no_allreduce", lambda s: _n_gt1(s) and _moves(s), "no all-reduce: each rank applies its own gradient",
              base="hand_allreduce"),
    _torchbug("rank0_loss", _n_gt1, "rank 0's own loss logged (no grads=)", logs=True),
    _torchbug("last_rank_loss", _n_gt1, "the last rank's loss logged (no grads=)", logs=True),
    _torchbug("ranks_sum_loss", _n_gt1, "the ranks' losses summed in the log (no grads=)", logs=True),
    _torchbug("loss_after_update_torch", _moves, "the loss logged after the update (no grads=)", logs=True),
    # in a user's model.fit program (programs.py), where Keras' own float32(1/N) loss scale is mapped (issue 35)
    Bug("keras_fit_lr_high", program("keras_fit_lr_high"), program("keras_fit"), _lr_resolved,
        "model.fit with the learning rate 1.001 times the case's"),
    Bug("keras_fit_loss_over_n", program("keras_fit_loss_over_n"), program("keras_fit"),
        lambda s: _n_gt1(s) and _moves(s) and _scale_matters(s), "model.fit's loss divided by N again"),
]


# ---------------------------------------------------------------- case-level bugs of the built-ins


def _with_spec(case: Case, change: Callable[[dict], None]) -> Case:
    """``case`` (any subclass: a perturbed rerun keeps its row order) with its spec changed in place of a copy."""
    spec = copy.deepcopy(case.spec)
    change(spec)
    return dataclasses.replace(case, spec=spec)


def _set_opt(key: str, fn: Callable[[dict], Any]) -> Callable[[Case], Case]:
    def mutate(case: Case) -> Case:
        def change(s: dict) -> None:
            # a perturbed rerun of a built-in may compute on one device (``run_devices``: the case's own N)
            n = getattr(case, "run_devices", None) or s["parallel"]["devices"]
            s["optimizer"][key] = fn({**s, "parallel": {**s["parallel"], "devices": n}})

        return _with_spec(case, change)

    return mutate


def _next_batch(case: Case) -> Case:
    """Every step reads the next step's global batch (an extra ``next()`` on the iterator); the last wraps."""
    b = case.spec["data"]["global_batch"]
    used = b * case.spec["steps"]
    order = np.r_[np.arange(b, used), np.arange(0, b), np.arange(used, len(case.x))]
    return dataclasses.replace(case, x=case.x[order], y=case.y[order])


def _flip(path: tuple[str, str], values: tuple[str, str]) -> Callable[[Case], Case]:
    def mutate(case: Case) -> Case:
        def change(s: dict) -> None:
            s[path[0]][path[1]] = values[1] if s[path[0]][path[1]] == values[0] else values[0]

        return _with_spec(case, change)

    return mutate


def _gross(spec: dict) -> bool:
    """A mixed_bfloat16 case resolves only changes far above bfloat16 rounding: a rate that moves the weights."""
    return spec["dtype"] != MIXED_BFLOAT16 or _bug_lr(spec) >= 0.05


def mutant(name: str, builtin: str) -> str:
    """The implementation name of ``builtin`` with the case-level bug ``name`` (:func:`register_mutants`)."""
    return f"mutant:{name}@{builtin}"


MUTATIONS: list[Bug] = []
for _impl in ("tf.towers", "torch.ddp", "tf.single", "torch.single"):
    _par = BY_NAME[_impl].parallel
    MUTATIONS += [
        Bug("lr_times_n", mutant("lr_times_n", _impl), _impl,
            lambda s, p=_par: p and _n_gt1(s) and _moves(s) and _gross(s),
            "the learning rate multiplied by N (the linear scaling rule applied on top of summed gradients)",
            _set_opt("lr", lambda s: s["optimizer"]["lr"] * s["parallel"]["devices"])),  # the case's own N
        Bug("momentum_dropped", mutant("momentum_dropped", _impl), _impl,
            lambda s: s["optimizer"]["name"] == "momentum" and s["optimizer"]["momentum"] > 0 and s["steps"] >= 2
            and _moves(s) and _gross(s), "momentum left at the other framework's default 0",
            _set_opt("momentum", lambda s: 0.0)),
        Bug("next_batch", mutant("next_batch", _impl), _impl, lambda s: s["steps"] >= 2 and _gross(s),
            "every step reads the next step's batch (an extra next() on the iterator)", _next_batch),
        Bug("weighting_flipped", mutant("weighting_flipped", _impl), _impl,
            lambda s, p=_par: p and _n_gt1(s) and _uneven(s) and _gross(s) and s["model"]["reduction"] == "mean",
            "equal and by_size weighting swapped on uneven shards", _flip(("parallel", "weighting"), ("equal", "by_size"))),
        Bug("reduction_flipped", mutant("reduction_flipped", _impl), _impl,
            # mixed_bfloat16 judged the parameters only when this was written (its mixed loss is reported, not judged;
            # since 2026-11-29 its float64 runs' loss is, so this keeps to cases both channels catch), and Adam with a
            # small epsilon, a clip after the combine that is reached, or a per-device clip always reached (each
            # device's gradient normalised before the combine) takes the flip's scale away from them (found by the
            # hunts of 2026-11-28: Adam with epsilon 0; momentum behind a 1e-6 per-device clip)
            lambda s: max(_elements_per_device(s)) > 1 and _gross(s)
            and (s["dtype"] != MIXED_BFLOAT16 or (_scale_matters(s) and not (
                _clip(s) is not None and _clip(s)["where"] == "per_device" and _clip(s)["global_norm"] == ALWAYS))),
            "a shard's loss summed where the case means it (or the reverse)",
            _flip(("model", "reduction"), ("mean", "sum"))),
    ]
BUGS: list[Bug] = BUG_PLUGINS + MUTATIONS


def register_mutants() -> None:
    """Register every case-level bug as an implementation of its own (``mutant:<bug>@<built-in>``).

    It is the built-in run on the mutated case, registered as a *plugin* of the built-in's
    framework and kind: the judge treats it as code under test (its perturbed rerun keeps its
    device count and row order; a predicted difference is mapped through the clean built-in as
    its stand-in), which is what a seeded bug models. Registered in this process only: replay
    such a pair with ``bench_error_rates.py --replay``.
    """
    from parity_tests.running import registry

    for bug in MUTATIONS:
        if registry.lookup(bug.impl) is not None:
            continue
        base = registry.resolve(bug.base)

        def run(case: Case, progress: Callable | None = None, base=base, mutate=bug.mutate) -> dict:
            return base.run(mutate(case), progress)

        # declared under its own name (the built-in's declaration names the built-in): else theory finds no
        # declaration for it and takes it for a run that splits nothing, of framework "mutant:...@tf" (found by
        # the schedule hunt, 2026-11-28: weighting_flipped@torch.ddp against tf.towers "predicted" as uneven
        # shards with equal weighting, whose mapping is the bug itself)
        declared = dataclasses.replace(base.spec, name=bug.impl, kind="plugin",
                                       description=f"{bug.base} with the seeded bug {bug.name}")
        registry.register(dataclasses.replace(base, spec=declared, run=run))


def mutated_runner(bug: Bug | None = None) -> Callable[[Case, str], dict]:
    """``runner(case, impl)`` for ``compare_case``: every implementation as registered, the mutants registered first."""
    from parity_tests.running.harness import run_impl

    register_mutants()

    def run(case: Case, impl: str) -> dict:
        return run_impl(case, impl)

    return run


# ---------------------------------------------------------------- the ground truth


def _f32_exact(v: float) -> bool:
    return float(np.float32(v)) == v


#: momentum's two conventions under a rate that changes
MOMENTUM = "momentum: Keras' buffer holds the changing rate, torch's does not"
#: the difference of a ``warmup_cosine`` between a side running Keras' ``CosineDecay`` and one running the curve
LATE = "Keras' CosineDecay one step late (step t at the curve's rate of step t - 1)"


def differences(spec: dict, a: Impl, b: Impl) -> tuple[list[str], list[str]]:
    """``(certain, possible)``: where ``a`` and ``b`` compute different updates in exact arithmetic on ``spec``.

    ``certain`` differences show on this case; ``possible`` ones may or may not (a clip
    threshold of 0.5 that some steps reach, bfloat16 rounding of different ops). Written
    from the construction of the two implementations (module docstring).
    """
    certain: list[str] = []
    possible: list[str] = []
    o, par, n = spec["optimizer"], spec["parallel"], spec["parallel"]["devices"]
    if a.parallel != b.parallel and n > 1:
        if spec["model"]["reduction"] == "sum":
            certain.append("sum reduction over N devices vs one")
        elif par["weighting"] == "equal" and _uneven(spec):
            certain.append("equal weighting of uneven shards vs one device")
        c = _clip(spec)
        if c is not None and c["where"] == "per_device":
            (certain if c["global_norm"] == ALWAYS else possible if c["global_norm"] != NEVER else []).append(
                "per-device clip vs one device")

    def rule(i: Impl) -> str:
        return i.framework if o["semantics"] == "native" else o["semantics"]

    if rule(a) != rule(b):
        if o["name"] == "adam" and o["epsilon"] > 0:
            certain.append("Adam epsilon placement")
        c = _clip(spec)
        if c is not None and c["global_norm"] != NEVER:
            possible.append("clip_grad_norm_'s 1e-6")
        # Keras' v <- m v - lr_t g (the buffer holds past rates) against torch's b <- m b + g, p <- p - lr_t b:
        # the same for a constant rate only (step 2: m lr_1 g_1 + lr_2 g_2 against lr_2 (m g_1 + g_2))
        if (o["name"] == "momentum" and o["momentum"] > 0 and cosine(spec) is not None
                and len(set(rates(spec, a.late(spec)) + rates(spec, b.late(spec)))) > 1):
            certain.append(MOMENTUM)
    if a.late(spec) != b.late(spec):  # step 1 at 0 on one side, f(1) = lr / k > 0 on the other
        certain.append(LATE)
    # a schedule's rates: Keras' CosineDecay is float32 on every late side, the curve exact on the others (above)
    held = {**({} if cosine(spec) is not None else {"lr": o["lr"]}), **({"momentum": o["momentum"]} if o["name"] == "momentum" else {}),
            **({"beta1": o["beta1"], "beta2": o["beta2"]} if o["name"] == "adam" else {})}
    if any(not _f32_exact(held[k]) for k in a.rounded(spec) ^ b.rounded(spec) if k in held):
        certain.append("Keras' float32 hyperparameters in a float64 run")
    if spec["dtype"] == "float32":
        # a float32 case is decided by its float64 runs, where Keras holds the same float32 numbers: visible above
        # float32's noise (about 1e-7) only where the rounding is large for its use, 1 - beta for a beta near 1
        # (1 - float32(0.999999) is 1.3e-2 off 1 - 0.999999), lr and momentum for themselves
        f64 = {**spec, "dtype": "float64"}

        def size(k: str) -> float:
            v = held[k]
            return abs(float(np.float32(v)) - v) / ((abs(1 - v) if k.startswith("beta") else abs(v)) or 1.0)

        if any(size(k) > 1e-6 for k in a.rounded(f64) ^ b.rounded(f64) if k in held):
            possible.append("Keras' float32 hyperparameters in the float64 runs that decide a float32 case")
    if a.fit != b.fit and n & (n - 1):  # float32(1/N) N != 1 where N is not a power of two
        (certain if spec["dtype"] == "float64" else possible).append("Keras' float32 distribution loss scale")
    if spec["dtype"] == MIXED_BFLOAT16 and a.framework != b.framework:
        possible.append("bfloat16 rounding of different ops")
    return certain, possible


#: ``update_scale x steps`` below which a run's parameters may count as unmoved: (float32 or bfloat16, float64).
#: The judge calls a parameter unmoved within 1e-10 relative in float64; in float32 one ulp is 6e-8. The
#: estimate is rough (its gradient size is a guess), hence a decade of margin above each.
STILL = (1e-5, 1e-8)


def _still(*trajs: dict | None) -> bool:
    """Every gradient the runs ``trajs`` record exactly zero at every step (a dead network: nothing to compare).

    Both sides of a pair: one side's combined gradient may be exactly zero where the other's is not, without a
    dead network (the seed-1 hunt's pairs 857, 858: two devices of one row each, their gradients of opposite sign
    each clipped to 1e-6 before the mean, which is then exactly 0 in torch.ddp, while tf.single clips the full
    batch's gradient to -1e-6 and moves): that is the difference a per-device clip makes, not a dead network."""
    grads = [np.asarray(t[k]) for t in trajs for k in (t or {}) if k.startswith("grad/")]
    return bool(grads) and all(not np.any(g) for g in grads)


def _dead(traj: dict | None) -> bool:
    """The correct reference's run ``traj`` records gradients and every one is exactly zero at every step: the case's
    network is dead (a dead ReLU unit on every row), whatever a seeded bug on the other side does. Its *recorded*
    gradients, all of them: a run that records none (no ``grads=``) says nothing (:func:`_still`'s caveat: one side's
    combined gradient exactly zero is no dead network where the other moves, hence :func:`judgement` asks both
    sides' parameters too)."""
    return traj is not None and any(k.startswith("grad/") for k in traj) and _still(traj)


def _vacuous_case(spec: dict) -> bool:
    """A case whose parameters do not move, or barely (:data:`STILL`): lr 0, or updates below the dtype."""
    return _lr(spec) == 0 or update_scale(spec) * spec["steps"] < STILL[spec["dtype"] == "float64"]


#: The contract's denominator floor of a relative gap (docs/tolerance.md, ``d_p = max(||A_p||, ||B_p||, 1e-2)``): an
#: array below it, a zero-initialised bias, is measured against 1e-2, so "relative" here means what it means there.
RELATIVE_FLOOR = 1e-2


def _moved(traj: dict | None, still: float) -> bool:
    """Whether a recorded parameter of ``traj`` ends more than ``still`` (relative, against
    :data:`RELATIVE_FLOOR` at least) from where it started (:data:`STILL`: below it the judge may call it
    unmoved); ``None`` (not known): yes. A zero-initialised bias moved by 1e-14 has not moved 1e16 times its
    size: it has moved 1e-12 of the contract's scale (the seed-1 hunt's pairs 1064 and 1065, lr 1e-7 behind a
    clip of 1e-6, every array within 2e-13 of its start and the zero bias counted as moved)."""
    if traj is None:
        return True
    for k in traj:
        if k.startswith("param/"):
            r = np.asarray(traj[k], np.float64).reshape(len(traj[k]), -1)
            scale = max(float(np.max(np.abs(r[0]), initial=0.0)), RELATIVE_FLOOR)
            with np.errstate(invalid="ignore"):
                if len(r) > 1 and not float(np.max(np.abs(r[-1] - r[0]), initial=0.0)) / scale <= still:
                    return True  # (a NaN is movement: nothing vacuous about it)
    return False


def _nonfinite(traj: dict | None) -> bool:
    if traj is None:
        return False
    return any(k == "loss" or k.startswith(("param/", "grad/")) for k in traj
               if np.asarray(traj[k]).size and not np.all(np.isfinite(np.asarray(traj[k], np.float64))))


def _overflow(ref_traj: dict | None, impl_traj: dict | None, ref64: dict | None, impl64: dict | None) -> bool:
    """Both runs non-finite, in the case dtype or in float64 (the runs a float32 case's verdict reads first): the
    reference is correct code, so the case itself leaves the numbers (Adam with epsilon 0 divides 0 by 0 wherever a
    gradient element is exactly 0, a dead unit's), whatever the other side is."""
    return (_nonfinite(ref_traj) and _nonfinite(impl_traj)) or (_nonfinite(ref64) and _nonfinite(impl64))


def truth(spec: dict, a: Impl, b: Impl) -> tuple[tuple[str, ...], str]:
    """The right verdicts of the equivalent pair ``(a, b)`` on ``spec`` and why (before looking at any run)."""
    if _lr(spec) == 0:
        return ("inconclusive",), "lr 0: no parameter moves"
    certain, possible = differences(spec, a, b)
    # parameters that move by less than the dtype resolves may be called unmoved (CONTRACT §8: inconclusive)
    moved = max(sum(update_scale(spec, r, t, keras_rule(spec, i)) for t, r in enumerate(rates(spec, i.late(spec)), 1))
                for i in (a, b))  # the side moving most
    still = ("inconclusive",) if moved < STILL[spec["dtype"] == "float64"] else ()
    why = " (the parameters barely move: inconclusive allowed)" if still else ""
    if LATE in certain:  # step 1 moves on one side only, by lr / k times the gradient: never hidden by noise
        return ("expected_difference", *still), "; ".join(certain + [p + " (possibly)" for p in possible]) + why
    if certain or possible:
        return OK + still, "; ".join(certain + [p + " (possibly)" for p in possible]) + why
    return ("parity", *still), "the same updates in exact arithmetic" + why


@dataclass
class Pair:
    """One drawn pair: its case, reference and other implementation, and for a bug pair the bug."""

    raw: dict
    reference: str
    impl: str
    bug: Bug | None = None

    @property
    def kind(self) -> str:
        return "bug" if self.bug else "equivalent"

    def case(self) -> Case:
        return case_from_dict(copy.deepcopy(self.raw))

    def describe(self) -> str:
        s = self.raw
        o, par = s["optimizer"], s["parallel"]
        hp = ", ".join(f"{k} {o[k]:g}" for k in ("lr", "momentum", "beta1", "beta2", "epsilon") if k in o)
        clip = par.get("clip")
        cl = f", clip {clip['global_norm']:g} {clip['where']}" if clip else ""
        cs = cosine(s)
        if cs is not None:
            cl += f", warmup_cosine k {cs['warmup_steps']} d {cs['decay_steps']} min_lr {cs['min_lr']:g}"
        sizes = shard_sizes(s)
        return (f"{s['dtype']}, {par['devices']} dev (shards {min(sizes)}-{max(sizes)}), {par['combine']}, "
                f"{par['weighting']}, {s['model']['loss']}/{s['model']['reduction']}, {o['name']} {o['semantics']} "
                f"({hp}){cl}, {s['steps']} steps")


def judgement(pair: Pair, status: str, ref_traj: dict | None = None, impl_traj: dict | None = None,
              ref64: dict | None = None, impl64: dict | None = None) -> tuple[bool, str]:
    """``(right, why)`` for ``status``, the verdict of ``pair`` (the trajectories in the case dtype and, for a
    float32 case, in float64: for the overflow rule; the float64 runs are the ones a float32 case's verdict reads
    first, and Adam with epsilon 0 divides 0 by 0 there wherever a gradient element is exactly 0, a dead unit's,
    where float32's rounding may leave it a tiny nonzero: the hunt's pair 976 of 2026-11-29, both float64 runs NaN
    from step 1 and the float32 ones finite)."""
    if pair.bug is not None:
        still = STILL[pair.raw["dtype"] == "float64"]
        if status == "inconclusive" and _vacuous_case(pair.raw) and not any(_moved(t, still) for t in (ref_traj, impl_traj)):
            # CONTRACT §8: where no parameter moves nothing was compared, whatever the logged loss says; the case
            # (lr 0, or updates below the dtype), not the judge, leaves the bug unseen (counted apart in the table)
            return True, f"nothing moves on either side (CONTRACT §8: inconclusive): {pair.bug.why}"
        if (status == "inconclusive" and _dead(ref_traj)
                and not any(_moved(t, still) for t in (ref_traj, impl_traj))):
            # CONTRACT §8 again: every gradient the correct reference computes is exactly zero (a dead network: its
            # recorded gradients, all of them, at every step) and no parameter moves on either side, so the case, not
            # the bug, leaves nothing to compare, as at lr 0 (the 10,000-pair run's s2-1127, s4-1104: a loss-only bug,
            # no grads=, beside a reference whose every gradient is 0; counted apart with the cases where nothing moves)
            return True, f"nothing moves on either side, every gradient of the reference 0 (CONTRACT §8): {pair.bug.why}"
        if status in ("error", "inconclusive") and _overflow(ref_traj, impl_traj, ref64, impl64):
            # rule 3, the equivalent pairs' predicate: the correct reference overflows too, so the case, not the bug,
            # leaves nothing to compare (the seed-1 hunt's pairs 1161-1163: next_batch under Adam epsilon 0, tf.single
            # and the clean torch.ddp NaN from step 1 in float64 as the mutant is); one side alone non-finite is a
            # divergence the judge must find (rules/nonfinite.py), a miss as before
            return True, f"both runs overflow, the correct one too (error or inconclusive right): {pair.bug.why}"
        if status not in pair.bug.caught_by():
            return False, f"missed ({status}): {pair.bug.why}"
        return True, pair.bug.why
    a, b = BY_NAME[pair.reference], BY_NAME[pair.impl]
    allowed, why = truth(pair.raw, a, b)
    if _overflow(ref_traj, impl_traj, ref64, impl64):
        # a difference certain at step 1 shows in its loss, computed before any update can overflow
        certain = differences(pair.raw, a, b)[0]
        allowed = ("error", "inconclusive") + (("expected_difference",) if certain else ())
        why = "both runs overflow" + (f" (after step 1's loss, where {'; '.join(certain)} shows)" if certain else "")
    elif _still(ref_traj, impl_traj):
        allowed, why = ("inconclusive",), "every gradient is exactly zero (a dead network)"
    elif "inconclusive" not in allowed and _cancelled(pair.raw, ref_traj, impl_traj):
        allowed = (*allowed, "inconclusive")
        why += (" (per-device clipped gradients of norm c each, whose mean can be any norm from 0 to c, left every"
                " parameter of both sides unmoved: inconclusive allowed)")
    return status in allowed, f"{why}; right: {' or '.join(allowed)}"


def _cancelled(spec: dict, *trajs: dict | None) -> bool:
    """A per-device clip reached at every step whose devices' clipped gradients cancelled in the combine, on both
    sides: neither run moved a parameter beyond :data:`STILL` (read from the runs).

    Why from the construction: a per-device clip of threshold ``c`` that is always reached gives every device a
    gradient of norm exactly ``c``; the combine's weighted mean of such vectors has any norm from ``c`` down to 0
    (vectors of opposite direction). :func:`update_scale` takes ``c``, an upper bound here, not a size. The
    10,000-pair run's s3-0801/0803: one weight, two devices of one row each, their gradients of opposite sign
    clipped to ``-1e-6`` and ``+1e-6``: the mean is 0 in exact arithmetic (and 0 or 1e-22 as computed), no
    parameter moves on either side, and the judge's ``inconclusive`` (CONTRACT §8) is right. A side that does not
    clip per device (one device, the full batch clipped to ``c``) moves, and nothing is allowed."""
    c = _clip(spec)
    if c is None or c["where"] != "per_device" or c["global_norm"] != ALWAYS or _n(spec) < 2:
        return False
    still = STILL[spec["dtype"] == "float64"]
    return all(t is not None for t in trajs) and not any(_moved(t, still) for t in trajs)


# ---------------------------------------------------------------- drawing pairs


def _valid(raw: dict) -> dict | None:
    try:
        return case_from_dict(copy.deepcopy(raw)).spec
    except CaseError:
        return None


def _still_case(spec: dict) -> bool:
    """Whether the parameters may barely move on some side (:data:`STILL`), under either reading of a schedule:
    a Keras ``CosineDecay`` run of one step moves nothing (step 1 at rate 0), a rate of 1e-7 behind a clip of
    1e-6 next to nothing. The judge then calls the pair ``inconclusive`` (docs/tolerance.md, "The verdict"), rightly, whatever a
    bug did to the loss; so schedule cases carry no seeded bug there (the schedule hunt of 2026-11-28 drew such
    a pair: ``same_shard`` at lr 1e-7, one step)."""
    late = rates(spec, late=spec["optimizer"]["semantics"] == "native")  # only a Keras optimizer under native is late
    lo = [min(a, b) for a, b in zip(rates(spec), late, strict=True)]
    return sum(update_scale(spec, r) for r in lo) < STILL[spec["dtype"] == "float64"]


def bug_weights(raws: list[dict]) -> dict[str, float]:
    """``{bug name: 1 / (the share of raws it applies to)}``: weights that even out how often each bug is drawn."""
    valid = [s for s in (_valid(r) for r in raws) if s is not None]
    out = {}
    for name in {bg.name for bg in BUGS}:
        hits = sum(any(bg.applies(s) and BY_NAME[bg.base].runs(s) for bg in BUGS if bg.name == name) for s in valid)
        out[name] = max(len(valid), 1) / max(hits, 1)  # no valid raw (an --only hunt that drew none): even weights
    return out


@st.composite
def pairs(draw, kind: str, weights: dict[str, float] | None = None,
          dtypes: tuple[str, ...] = ("float32", "float64", MIXED_BFLOAT16)) -> Pair:
    """An equivalent pair (``kind="equivalent"``) or a bug pair (``"bug"``, bugs weighted by ``weights``) on a drawn case."""
    raw = draw(specs(dtypes))
    spec = _valid(raw)
    if spec is None:
        from hypothesis import reject

        reject()
    able = [i for i in IMPLS if i.runs(spec)]
    # the implementations and the bug are picked uniformly (hypothesis' own choices favour a list's first items)
    rnd = draw(st.randoms(use_true_random=True))
    if kind == "equivalent":
        ref = rnd.choice(able)
        partners = [i for i in able if i is not ref and i.group == ref.group]  # the same computation only
        if not partners:
            from hypothesis import reject

            reject()
        return Pair(raw, ref.name, rnd.choice(partners).name)
    bugs = [bg for bg in BUGS if bg.applies(spec) and BY_NAME[bg.base].runs(spec)]
    if cosine(spec) is not None and _still_case(spec):
        bugs = []  # the case leaves nothing to compare (below): inconclusive is right there and says nothing of a bug
    if not bugs:
        from hypothesis import reject

        reject()
    # a bug that applies to few cases weighs more (``weights``: :func:`bug_weights`), so every bug is drawn about
    # as often as the others; picking among the applicable ones needs no rejection (which hypothesis answers by
    # mutating the one accepted example over and over)
    bug = rnd.choices(bugs, [weights.get(bg.name, 1.0) for bg in bugs])[0] if weights else rnd.choice(bugs)
    # a built-in's perturbed rerun (against a float32-only reference) may compute the full batch on one
    # device, where a case-level mutation means something else: such references are left out
    refs = [i for i in able if i.name != bug.impl and i.group == "case"
            and not (bug.mutate is not None and i.label.endswith("_f32"))]
    if not refs:
        from hypothesis import reject

        reject()
    ref = rnd.choice(refs)
    return Pair(raw, ref.name, bug.impl, bug)


def behind(pair: Pair) -> list[str]:
    """For a bug pair: the differences the reference has with the bug's correct base (a bug may hide behind them)."""
    if pair.bug is None:
        return []
    spec = pair.case().spec
    certain, possible = differences(spec, BY_NAME[pair.reference], BY_NAME[pair.bug.base])
    return certain + possible
