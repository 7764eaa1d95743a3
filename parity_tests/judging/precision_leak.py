"""A float64 run that is not float64 throughout: its loss computed in float32 (docs/tolerance.md, "Precision leaks").

A float32 case is decided by its float64 runs (``rules.judge_float32``), which assumes that a
float64 run computes in float64. A framework op can break that where no user code can reach:
``tf.compat.v1.losses.*`` (``compute_weighted_loss``) casts the per-example losses to float32,
sums and divides them there and casts the mean back, even in a float64 graph; a Keras loss made
under the default floatx computes in float32. The run's loss is then a float32 number, and two
correct programs part on that channel by float32 rounding (measured: 9.3e-9 relative on a
slim-style program against its DDP port, parameters agreeing to 5e-16), far above the float64
bound ``FLOAT64_RTOL = 1e-10``.

**Detection.** A float32 number has 24 significant bits, so as a float64 its 29 low mantissa bits
are zero; the mean of a few such numbers (the towers' losses added in float64 and divided by a
power of two) keeps at least ``52 - 24 - log2(towers) - (their exponents' spread)`` of them zero.
A loss computed in float64 from float64 parameters has low bits spread evenly (those of a
rounding of a real number): ``LEAK_ZERO_BITS = 16`` or more of them are zero with probability
``2**-16`` per step. So a float64 run whose loss has at least 16 low zero bits at *every* step
(non-zero, finite steps; a false alarm needs ``2**-16`` per step, at least once) while its
parameters do not (the run does compute in float64) has computed its loss in float32 or from
float32 numbers. A run with no such step is not called leaky. What a false alarm costs is bounded:
the loss channel of a float32 case judged at the float32 noise, which is what its float32 runs
resolve anyway, and a named note.

**Bound.** Such a loss holds the rounding of a float32 evaluation, whose size the float64 runs
cannot tell: on that channel the float64 rule has nothing to resolve below float32. The loss is
then judged by what the float32 runs resolve (``rules.judge_float32``): the float64 runs' loss
gap against the float32 rule's loss bound, ``FLOAT32_FACTOR * max(floor_A, floor_B) +
FLOAT32_ABS_FLOOR`` with ``floor_X = |L_X32 - L_X64| / d_L`` (the float32 runs' own loss error;
the leaky side's float64 loss differs from its exact loss by one float32 evaluation, at most
what its float32 run's loss differs by, plus the absolute floor of four float32 unit
roundoffs). The parameters keep the float64 rule unless it finds them apart: the cast is
differentiated too (a cast's gradient casts back), so the leaky side's gradients and parameters
carry float32 rounding as well, and their float64 gap is then held to the float32 rule's parameter
bound (the float32 runs' own floors; ``rules.float32_floor.judge_float32``): parity within it, the
float64 divergence above it. In a float64 case there are no float32 runs:
the leak is named beside the verdict, which stands (the program does not compute in float64).

**A float32 constant read from the run.** A float32 number inside an otherwise float64 computation
need not clear any low bit: Keras' regularizers cast their Python-float factor through float32
(``L2(1e-3)`` adds ``float32(1e-3) |w|^2`` to a float64 loss, ``1e-3 (1 + 4.7e-8)``; measured: a
``model.fit`` with ``L2(1e-3)`` kernels and its DDP port, float64, part at step 1's loss by
5.2957e-10 absolute, exactly ``(float32(1e-3) - 1e-3) |w|^2``). Such a run is not detected from
its bits but read from the run itself (``tfpar.keras_seen.keras_float32_constants_seen``, the run's
``meta["keras_float32_constants"]``), and it is judged as a leaky loss is: the factor is in the loss
and, differentiated, in every gradient, so both channels of a float32 case are held to the float32
noise (the float32 runs hold the same float32 factor on both sides: ``float32(1e-3)`` is what a
torch port's ``1e-3 * w.pow(2).sum()`` multiplies by in float32 too). :func:`not_float64` is the
one question every rule asks; :func:`leak_text` names the cause.

**A float32 reduction read from the run.** The bits do not always show the leak: a slim-style trainer
scales its clone losses by ``1/N`` in float64 *after* ``tf.compat.v1.losses`` made them float32
numbers, and at ``N`` not a power of two the product's low bits are spread as any float64 number's
(the hunt's ``v1_losses`` at 5 and 6 clones: its float64 losses had 0 and 1 low zero bits, and the
pairs were divergences on the loss at 1.3e-8 and 2.0e-8 relative, and on the parameters at 2e-10 and
1.2e-8, against a DDP port: float32 rounding, nothing else). The run records every float64 loss such
a function reduced in float32 (``tfpar.v1_losses_seen``, the run's ``meta["float32_losses"]``), and
:func:`loss_in_float32` reads that first: what the run did, not a guess from its bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.protocol.rows import iter_rows

__all__ = ["loss_in_float32", "float32_losses", "float32_constants", "not_float64", "leak_text", "LEAK_ZERO_BITS"]


#: low mantissa bits that must be zero at every step for a float64 run's loss to count as float32 (docstring)
LEAK_ZERO_BITS = 16
_MANTISSA = np.uint64((1 << 52) - 1)


def _short(a: np.ndarray) -> np.ndarray:
    """Per element of the float64 array ``a``: at least :data:`LEAK_ZERO_BITS` low mantissa bits are zero."""
    m = np.ascontiguousarray(a, np.float64).view(np.uint64) & _MANTISSA
    return (m & np.uint64((1 << LEAK_ZERO_BITS) - 1)) == 0


def float32_losses(traj: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The float64 losses the run ``traj`` said it reduced in float32 (module docstring, "A float32 reduction read
    from the run"): ``[{"what": "tf.compat.v1.losses.compute_weighted_loss", "dtype": "float64", ...}]``."""
    return [e for e in getattr(traj, "meta", {}).get("float32_losses") or () if e.get("dtype") == "float64"]


def loss_in_float32(traj: Mapping[str, Any] | None) -> bool:
    """Whether the float64 run ``traj`` computed its loss in float32: it says so (:func:`float32_losses`), or its
    loss has float32's low bits at every step while its parameters do not (module docstring, "Detection")."""
    if traj is None or "loss" not in traj:
        return False
    if float32_losses(traj):
        loss = np.asarray(traj["loss"])
        return loss.dtype == np.float64
    loss = np.asarray(traj["loss"])
    if loss.dtype != np.float64:
        return False
    seen = loss[np.isfinite(loss) & (loss != 0)]
    if seen.size == 0 or not bool(np.all(_short(seen))):
        return False
    for key in traj:  # its parameters computed in float64: not a run that is float32 throughout
        if isinstance(key, str) and key.startswith("param/"):
            for _, chunk in iter_rows(traj[key]):
                chunk = np.asarray(chunk)
                if chunk.dtype == np.float64 and not bool(np.all(_short(chunk[np.isfinite(chunk) & (chunk != 0)]))):
                    return True
    return False


def float32_constants(traj: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The float32-rounded constants the float64 run ``traj`` read of itself (module docstring, "A float32
    constant read from the run"): ``[{"what": "keras.regularizers.L2", "name": "l2", "value", "held"}, ...]``."""
    return list(getattr(traj, "meta", {}).get("keras_float32_constants") or ())


def not_float64(traj: Mapping[str, Any] | None) -> bool:
    """Whether the float64 run ``traj`` is not float64 throughout: its loss computed in float32
    (:func:`loss_in_float32`) or a float32 constant in its computation (:func:`float32_constants`)."""
    return bool(float32_constants(traj)) or loss_in_float32(traj)


def leak_text(name: str, traj: Mapping[str, Any] | None = None) -> str:
    """The line a verdict gives for a side ``name`` whose float64 run ``traj`` is not float64 throughout."""
    held = float32_constants(traj)
    if held:
        what = ", ".join(f"{e['what']}({e['value']:g}) as {e['held']!r}" for e in held)
        return (f"the float64 run of {name} holds float32 constants: {what} (Keras casts the Python float through"
                " float32 whatever floatx says; no code of the plugin can make it exact)")
    said = float32_losses(traj)
    if said:
        return (f"the float64 run of {name} computes its loss in float32 inside {said[0]['what']} (read from the run:"
                " it casts the losses to float32, reduces them there and casts the result back, whatever the graph's"
                " dtype; no code of the plugin can make it float64)")
    return (f"the float64 run of {name} computes its loss in float32 (its loss has the low bits of float32 numbers"
            f" at every step, {LEAK_ZERO_BITS}+ zero bits, while its parameters are float64: a framework op reducing in float32, e.g. tf.compat.v1.losses,"
            " or a Keras loss made under floatx float32)")
