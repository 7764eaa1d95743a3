"""Localisation (CONTRACT §6): the first bad step and the earliest stage, read from the recorded channels.

Each case starts from one synthetic float64 trajectory (an SGD run of a
2-parameter model, so loss, gradient and parameters are consistent) and
changes exactly one thing; the verdict is the real float64 judge's.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.judging.localise import STAGES, localise, refinable
from parity_tests.judging.rules import judge_float64
from parity_tests.protocol.trajectory import Finding, Trajectory


def _run(steps: int = 5, *, lr=lambda k: 0.1, grad_scale=lambda k: 1.0, loss_scale=lambda k: 1.0,
         w0=(1.0, -2.0), state_shift=lambda k: 0.0) -> Trajectory:
    """Gradient descent on L(w) = 0.5 |w - t|^2 with gradient w - t, recording every channel."""
    t = np.array([0.5, 0.25])
    w = np.array(w0, np.float64)
    params, grads, losses, state = [w.copy()], [], [], [np.zeros(2)]
    for k in range(1, steps + 1):
        g = (w - t) * grad_scale(k)
        losses.append(0.5 * float(np.sum((w - t) ** 2)) * loss_scale(k))
        w = w - lr(k) * g
        params.append(w.copy())
        grads.append(g)
        state.append(state[-1] * 0.9 + 0.1 * w + state_shift(k))
    return Trajectory({"loss": np.array(losses), "param/0.kernel": np.stack(params), "grad/0.kernel": np.stack(grads),
                       "state/1.moving_mean": np.stack(state)})


def _where(b: Trajectory, a: Trajectory | None = None) -> dict:
    a = a if a is not None else _run()
    return localise(a, b, judge_float64(a, b))


@pytest.mark.parametrize(("b", "step", "stage", "name"), [
    (_run(w0=(1.0, -2.0 + 1e-6)), 0, "inputs", "0.kernel"),
    (_run(grad_scale=lambda k: 2.0 if k >= 3 else 1.0), 3, "combined_grads", "0.kernel"),
    (_run(lr=lambda k: 0.2 if k >= 2 else 0.1), 2, "update", "0.kernel"),
    (_run(state_shift=lambda k: 1e-3 if k == 4 else 0.0), 4, "state", "1.moving_mean"),
    (_run(loss_scale=lambda k: 1.5), 1, "record", None),
], ids=["initial-weights", "gradient-from-step-3", "learning-rate-from-step-2", "moving-statistics-at-4", "logged-loss"])
def test_the_first_bad_step_and_stage(b, step, stage, name):
    where = _where(b)
    assert (where["first_bad_step"], where["stage"], where["name"]) == (step, stage, name), where
    assert where["stage"] in STAGES and where["device"] is None
    assert where["gap"] > where["bound"] and where["explanation"].startswith(("before step 1", f"step {step}"))


def test_a_loss_that_differs_together_with_the_gradient_is_the_loss_stage():
    # a loss scaled by 2 and its gradient with it: the loss is the earliest stage that explains both
    b = _run(loss_scale=lambda k: 2.0 if k >= 2 else 1.0, grad_scale=lambda k: 2.0 if k >= 2 else 1.0)
    where = _where(b)
    assert (where["first_bad_step"], where["stage"]) == (2, "loss"), where


def test_without_recorded_gradients_a_parameter_gap_is_the_update():
    a, b = _run(), _run(lr=lambda k: 0.2 if k >= 2 else 0.1)
    for t in (a, b):
        del t["grad/0.kernel"]
    where = localise(a, b, judge_float64(a, b))
    assert (where["first_bad_step"], where["stage"]) == (2, "update") and "no gradient recorded" in where["explanation"]


def _replica_finding(step: int, rank: int, name: str, norms: list[float] | None = None, steps: int = 3):
    """The replica check's finding (running.plugins.replica_divergence, the real producer) for ranks whose
    ``name`` parts from rank 0's on ``rank`` after ``step``; ``norms``: each rank's applied |g| at every step."""
    from parity_tests.running.plugins import replica_divergence

    n = len(norms) if norms is not None else max(rank + 1, 2)
    ranks = []
    for r in range(n):
        digests = [{name: "same" if (r != rank or row < step) else "moved", "other": "same"} for row in range(steps + 1)]
        rec = {"digests": digests}
        if norms is not None:
            rec["grad_norms"] = [{name: norms[r], "other": 1.0} for _ in range(steps)]
        ranks.append(rec)
    return replica_divergence(ranks, "x")


def test_replicas_out_of_sync_name_the_rank():
    b = _run()
    b.findings.append(_replica_finding(3, 2, "1.bias"))   # no gradient norms recorded
    where = _where(b)
    assert (where["first_bad_step"], where["stage"], where["device"], where["name"]) == (3, "update", 2, "1.bias")
    assert where["ranks"] == {"name": "1.bias", "norms": None}


def test_ranks_that_applied_different_gradients_are_the_combined_gradient_of_a_rank():
    # the ranks' applied norms differ: the bug is each rank's gradient (FunASR #3472), not the optimizer's
    # step; the chain may not replace it
    b = _run()
    b.findings.append(_replica_finding(2, 1, "0.kernel", [4.0, 7.0, 4.0, 2.0]))
    where = _where(b)
    assert (where["first_bad_step"], where["stage"], where["device"], where["name"]) == (2, "combined_grads", 1,
                                                                                         "0.kernel"), where
    assert where["ranks"] == {"name": "0.kernel", "norms": [[0, 4.0], [1, 7.0], [3, 2.0]]}
    assert where["gap"] == pytest.approx(0.5) and where["bound"] == 0.0   # rank 3: |2 - 4| / 4
    assert "rank 1 7 (1.75x rank 0's), rank 3 2 (0.5x rank 0's)" in where["explanation"], where
    assert "rank 0's gradient against the reference's: gap 0 in 0.kernel" in where["explanation"], where
    assert not refinable(where, _run(), b)
    # the same norms on every rank (a rank skipped its step): the optimizer's step, as before
    c = _run()
    c.findings.append(_replica_finding(2, 1, "0.kernel", [4.0, 4.0]))
    same = _where(c)
    assert (same["stage"], same["device"]) == ("update", 1) and not refinable(same, _run(), c)
    assert same["ranks"] == {"name": "0.kernel", "norms": None}


def test_a_replica_finding_is_read_as_data_not_from_its_line():
    # the judge reads the finding's data: a line reworded (or translated, or cut by a log) localises the same,
    # and a line alone (no data) names no rank: nothing is parsed out of text
    found = _replica_finding(2, 1, "0.kernel", [4.0, 7.0])
    b = _run()
    b.findings.append(Finding("replicas out of sync (reworded)", found.data))
    where = _where(b)
    assert (where["first_bad_step"], where["stage"], where["device"]) == (2, "combined_grads", 1), where
    assert where["ranks"]["norms"] == [[0, 4.0], [1, 7.0]]
    plain = _run()
    plain.findings.append(str(found))   # the same words, no data
    assert _where(plain).get("ranks") is None


def test_parity_localises_nothing():
    where = _where(_run())
    assert where["first_bad_step"] is None and where["stage"] is None


# ---------------------------------------------------------------- the stage chain inside a captured step

def _captured(sizes=(3, 3), *, x_shift=None, act_shift=None, loss_scale=None, grad_scale=None, combine="equal") -> dict:
    """A captured step of a 2-device linear model y = x w, loss_r = mean over the shard of y, by hand."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(sum(sizes), 2))
    if x_shift is not None:
        x[x_shift] += 1.0
    w = np.array([[0.5], [-1.0]])
    act = x @ w
    if act_shift is not None:
        act[act_shift] += 1.0
    parts = np.split(np.arange(len(x)), np.cumsum(sizes)[:-1])
    loss = np.array([act[ix].mean() for ix in parts])
    grads = np.stack([x[ix].mean(axis=0)[:, None] for ix in parts])
    if loss_scale is not None:
        loss[loss_scale[0]] *= loss_scale[1]
    if grad_scale is not None:
        grads[grad_scale[0]] *= grad_scale[1]
    weights = np.asarray(sizes) / sum(sizes) if combine == "by_size" else np.full(len(sizes), 1 / len(sizes))
    combined = np.tensordot(weights, grads, axes=1)
    return {"device/step": np.asarray(1), "device/x": x, "device/sizes": np.asarray(sizes), "device/act/0": act,
            "device/loss": loss, "device/grad/0.kernel": grads, "device/combined/0.kernel": combined,
            "grad/0.kernel": combined[None]}


@pytest.mark.parametrize(("change", "stage", "device"), [
    ({"x_shift": 4}, "inputs", 1),                 # a row of device 1 (rows 3-5) is another row
    ({"act_shift": 0}, "forward", 0),              # device 0's activations differ
    ({"loss_scale": (1, 2.0)}, "loss", 1),
    ({"grad_scale": (0, 0.5)}, "device_grads", 0),
    ({"combine": "by_size", "sizes": (4, 2)}, "combined_grads", None),
])
def test_the_stage_chain_names_the_first_stage_and_device_that_break(change, stage, device):
    from parity_tests.judging.localise import stage_chain

    sizes = change.pop("sizes", (3, 3) if change.get("combine") != "by_size" else (4, 2))
    a = _captured(sizes)  # equal weighting, the reference
    b = _captured(sizes, **change)
    where = stage_chain(a, b, 1, 1e-10)
    assert (where["stage"], where["device"]) == (stage, device), where["explanation"]
    assert where["gap"] > where["bound"]
    assert [c["stage"] for c in where["chain"]][-1] == stage


def test_the_stage_chain_says_by_how_much_and_which_combination():
    from parity_tests.judging.localise import stage_chain

    where = stage_chain(_captured(), _captured(grad_scale=(0, 0.5)), 1, 1e-10)
    assert "by 0.5x" in where["explanation"] and "device 0" in where["explanation"]
    where = stage_chain(_captured((4, 2), combine="by_size"), _captured((4, 2)), 1, 1e-10)
    assert "shard size" in where["explanation"] and "equal mean" in where["explanation"]
    assert "4/2 rows" in where["explanation"]


def _accumulating(k: int, lr: float = 0.01, wd: float = 0.01) -> dict:
    return {"parallel": {"accumulate": k}, "optimizer": {"name": "adamw", "lr": lr, "weight_decay": wd},
            "model": {"layers": [{"type": "dense", "units": 1}]}, "data": {}}


@pytest.mark.parametrize("sizes", [(4,), (4, 4)])
def test_a_later_micro_batch_that_reads_moved_weights_is_an_update_inside_the_step(sizes):
    # keras #19990: weight decay applied after micro-batch 1 scales what micro-batch 2's first layer outputs by
    # 1 - lr x wd (a linear layer's output scales with its weights); micro-batch 1's rows agree on every device
    from parity_tests.judging.localise import stage_chain

    a, b = _captured(sizes), _captured(sizes)
    act = b["device/act/0"].copy()
    for start in np.cumsum((0, *sizes[:-1])):        # each device's second micro-batch: the last half of its rows
        n = sizes[0]
        act[start + n // 2:start + n] *= 1 - 0.01 * 0.01
    b["device/act/0"] = act
    where = stage_chain(a, b, 1, 1e-10, _accumulating(2))
    assert (where["stage"], where["device"]) == ("update", None), where["explanation"]
    assert where["gap"] == pytest.approx(1e-4, rel=1e-9)
    assert "micro-batch 2's output of layer 0" in where["explanation"]
    assert "0.9999x the reference's: 1 - lr x weight_decay" in where["explanation"], where["explanation"]
    # a ratio that is not the case's decay is said as a ratio only
    other = stage_chain(a, b, 1, 1e-10, _accumulating(2, wd=0.05))
    assert other["stage"] == "update" and "weight_decay" not in other["explanation"], other["explanation"]
    # must not fire: without accumulation it is the forward pass; nor where micro-batch 1 differs too
    assert stage_chain(a, b, 1, 1e-10, _accumulating(1))["stage"] == "forward"
    b["device/act/0"] = a["device/act/0"] * 1.001
    assert stage_chain(a, b, 1, 1e-10, _accumulating(2))["stage"] == "forward"


def test_shards_of_other_sizes_are_an_inputs_difference_and_nothing_captured_is_none():
    from parity_tests.judging.localise import stage_chain

    where = stage_chain(_captured((3, 3)), _captured((4, 2)), 1, 1e-10)
    assert (where["stage"], where["device"]) == ("inputs", 0)
    padded = stage_chain(_captured((6,)), _captured((4, 4)), 1, 1e-10)  # 8 rows on 2 devices against 6 on one
    assert (padded["stage"], padded["device"]) == ("inputs", None) and "8 rows in all" in padded["explanation"]
    assert stage_chain(_captured(), {"loss": np.zeros(1)}, 1, 1e-10) is None
    same = stage_chain(_captured(), _captured(), 1, 1e-10)
    assert same["stage"] is None and all(c["gap"] <= c["bound"] for c in same["chain"])


def test_update_without_recorded_gradients_is_refinable_and_with_them_is_not():
    from parity_tests.judging.localise import refinable

    where = {"first_bad_step": 2, "stage": "update"}
    with_grads = {"grad/0.kernel": np.zeros((1, 2))}
    assert refinable(where, with_grads, {"loss": np.zeros(1)})
    assert not refinable(where, with_grads, with_grads)
    assert refinable({"first_bad_step": 1, "stage": "combined_grads"}, with_grads, with_grads)
    assert not refinable({"first_bad_step": None, "stage": None}, {}, {})


def test_two_differences_at_one_step_are_both_named():
    """A logged loss that is wrong (what was logged) and moving statistics that are wrong at the same step: the
    state is the first computation that differs (the loss is only a record), and the line names both."""
    wrong_log = _run(loss_scale=lambda k: 1.01, state_shift=lambda k: 0.5)
    where = _where(wrong_log)
    assert (where["first_bad_step"], where["stage"]) == (1, "state")
    assert "the reported loss differs too" in where["explanation"]
    # the loss also computed differently (the parameters part later): the loss comes first, the state is named too
    both = _run(loss_scale=lambda k: 1.01, state_shift=lambda k: 0.5, lr=lambda k: 0.1 if k == 1 else 0.2)
    where = _where(both)
    assert (where["first_bad_step"], where["stage"]) == (1, "loss")
    assert "the non-trainable state differs at that step too" in where["explanation"]


def test_the_stage_chain_holds_a_few_arrays_not_both_sides_gradients(tmp_path):
    """Both sides' applied and combined gradients of a large model are four copies of it (a float64 GPT-2
    small: 4 GB in the main process): the chain reads them one parameter at a time from their files."""
    import tracemalloc

    from parity_tests.judging.localise import stage_chain
    from parity_tests.protocol.rows import to_file

    rng = np.random.default_rng(1)
    names = [f"{i}.kernel" for i in range(12)]
    grads = {p: rng.normal(size=(2, 128, 128)) for p in names}  # 2 devices, 128 KB a parameter

    def side() -> dict:
        x = rng.normal(size=(6, 2))
        out = {"device/step": np.asarray(1), "device/x": x, "device/sizes": np.asarray([3, 3]),
               "device/act/0": x[:, :1], "device/loss": np.zeros(2)}
        for p in names:
            combined = grads[p].mean(axis=0)
            out[f"device/grad/{p}"] = to_file(grads[p])
            out[f"device/combined/{p}"] = to_file(combined)
            out[f"grad/{p}"] = to_file(combined[None])
        return out

    a, b = side(), side()
    b["device/x"], b["device/act/0"] = a["device/x"], a["device/act/0"]
    model_bytes = sum(g[0].nbytes for g in grads.values())  # one copy of the model: 1.5 MB
    tracemalloc.start()
    try:
        where = stage_chain(a, b, 1, 1e-10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [c["stage"] for c in where["chain"]][-1] == "combined_grads" and where["stage"] is None
    assert peak < model_bytes, f"the chain held {peak / model_bytes:.2f} copies of the model at once"


# ---------------------------------------------------------------- which clip acted (issue 35)


def _clip_side(how: str, *, threshold: float = 1.0, scale: float = 1.0, dtype=np.float64) -> dict:
    """A captured step of 2 devices whose device gradients agree and whose applied gradient is clipped ``how``:
    ``after`` (one global-norm clip of the mean, computed on the gradient times ``scale``, then divided by it, as
    a loss-scaled program does), ``per_device`` (each device's gradient clipped, then the mean) or ``none``."""
    rng = np.random.default_rng(3)
    g = rng.normal(size=(2, 3, 2)).astype(dtype) * dtype(2.0)  # norms about 3.5: every clip at 1 acts
    if how == "after":
        s = (g.mean(axis=0) * dtype(scale)).astype(dtype)
        applied = s * dtype(min(1.0, threshold / float(np.linalg.norm(s)))) / dtype(scale)
    elif how == "per_device":
        applied = np.mean([gr * dtype(min(1.0, threshold / float(np.linalg.norm(gr)))) for gr in g], axis=0)
    else:
        applied = g.mean(axis=0)
    x = np.arange(12, dtype=dtype).reshape(6, 2)
    return {"device/step": np.asarray(1), "device/x": x, "device/sizes": np.asarray([3, 3]),
            "device/act/0": x[:, :1], "device/loss": np.ones(2, dtype), "device/grad/0.kernel": g,
            "grad/0.kernel": applied.astype(dtype)[None]}


_CLIP_SPEC = {"parallel": {"clip": {"global_norm": 1.0, "where": "after_combine"}, "weighting": "equal",
                           "shard": "contiguous"}, "data": {}, "model": {"layers": []}}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_the_clip_explanation_names_the_clip_that_acted(dtype):
    """A clip applied once to a loss-scaled gradient (S = 128) is one factor on the combined gradient, at
    threshold 1/128 of the case's: named as such, never "clipped per device?" (issue 35); a per-device clip is
    named with each device's norm and factor. In float32 too: one factor holds to float32 rounding there."""
    from parity_tests.judging.localise import stage_chain

    ref = _clip_side("after", dtype=dtype)
    scaled = stage_chain(ref, _clip_side("after", scale=128.0, dtype=dtype), 1, 1e-6, _CLIP_SPEC)
    text = scaled["explanation"]
    assert scaled["stage"] == "clip", text
    assert "per device" not in text and "each device" not in text, text
    assert text.count("clipped once after the combination") == 2, text
    assert "= 1 / " in text and "128x below the case's 1" in text and "loss scale" in text, text
    per = stage_chain(ref, _clip_side("per_device", dtype=dtype), 1, 1e-6, _CLIP_SPEC)["explanation"]
    assert "the other applied each device's gradient clipped before the equal mean (1/N each) (device norms" in per, per
    assert "= min(1, 1 / norm)" in per, per
    assert "clipped once after the combination" in per  # the reference's, named as what it is
    none = stage_chain(ref, _clip_side("none", dtype=dtype), 1, 1e-6, _CLIP_SPEC)["explanation"]
    assert "unscaled" in none and "no clip acted where one should" in none, none


def test_a_gap_of_float32_size_in_a_float64_run_is_named():
    """``1 / num_tokens`` computed in float32 in a float64 run (an int64 count made a float32 tensor) scales the
    gradient by ``fl32(1/3) * 3``, 1 + 3e-8: a gap of float32 rounding size no float64 arithmetic makes. The
    where-line says so; a gap far above it (a real factor) or a float32 run's own rounding does not."""
    from parity_tests.judging.localise import float32_sized

    third = float(np.float32(1 / 3)) * 3  # 1 - 2.98e-8: 0.5 x 2^-24
    where = _where(_run(grad_scale=lambda k: third))
    assert where["stage"] == "combined_grads" and where["gap"] < 1e-7, where
    assert "a gap of float32 rounding size (0.5 x 2^-24 relative) in a float64 run: something computes in float32" \
        in where["explanation"], where["explanation"]
    assert "float32" not in _where(_run(grad_scale=lambda k: 2.0 if k >= 3 else 1.0))["explanation"]
    assert float32_sized(6e-8, np.float32) == "" and float32_sized(1e-3, np.float64) == ""
    assert float32_sized(6e-8, np.float64) != "" and float32_sized(1e-11, np.float64) == ""


# ---------------------------------------------------------------- rows dealt otherwise (issue 35)


def _dealt_side(order: np.ndarray, *, hooks: bool, act_shift: float = 0.0) -> dict:
    """A captured step of 2 devices over the same 8 rows, device r holding ``order``'s rows 4r..4r+3 (a linear model,
    loss and gradient per device of its own rows); ``hooks``: the rows as a plugin's layer hooks saw them
    (``rows``: what its first layer received, flattened), else ``x`` as the built-ins record them."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(8, 2, 3))[order]
    w = rng.normal(size=(6, 2))
    act = x.reshape(8, -1) @ w
    act[4:] += act_shift  # device 1's layer output moved (batch-norm statistics of its own rows, say)
    parts = [slice(0, 4), slice(4, 8)]
    out = {"device/step": np.asarray(1), "device/sizes": np.asarray([4, 4]), "device/act/0": act,
           "device/loss": np.array([act[p].mean() for p in parts]),
           "device/grad/0.kernel": np.stack([np.tile(x[p].reshape(4, -1).mean(0)[:, None], (1, 2)) for p in parts])}
    out["device/rows" if hooks else "device/x"] = x.reshape(8, -1) if hooks else x
    out["grad/0.kernel"] = out["device/grad/0.kernel"].mean(axis=0)[None]  # equal shards' mean: the same either way
    return out


def test_rows_dealt_otherwise_are_an_inputs_difference_and_the_forward_pass_is_compared_on_matching_rows():
    """Contiguous slices (the reference, ``x``) against rows r::N (a plugin's hooks, ``rows``): the same 8 rows in all,
    on other devices. Named at ``inputs`` as the dealing it is, never "forward ... differs on every device" (the
    forward pass is the same on each row, issue 35); a layer that does compute otherwise on matching rows is
    named; the same dealing (rows in the same order) is not a finding."""
    from parity_tests.judging.localise import stage_chain

    contiguous, strided = np.arange(8), np.array([0, 2, 4, 6, 1, 3, 5, 7])
    ref = _dealt_side(contiguous, hooks=False)
    where = stage_chain(ref, _dealt_side(strided, hooks=True), 1, 1e-10)
    text = where["explanation"]
    assert (where["stage"], where["device"]) == ("inputs", None), text
    assert "the devices received different rows: the same 8 rows in all, dealt contiguous slices (the reference) vs" \
           " rows r, r+N, ... (the other, as DistributedSampler deals them)" in text, text
    assert "on matching rows the forward pass agrees" in text and "differs on every device" not in text, text
    assert "the gradient applied agrees" in text, text
    doubled = _dealt_side(strided, hooks=True)
    doubled["grad/0.kernel"] = 2 * doubled["grad/0.kernel"]
    assert "the gradient applied differs in 0.kernel (gap 0.5): more than the dealing" in \
        stage_chain(ref, doubled, 1, 1e-10)["explanation"]
    back = stage_chain(_dealt_side(strided, hooks=False), _dealt_side(contiguous, hooks=True), 1, 1e-10)
    assert "dealt rows r, r+N, ... (the reference, as DistributedSampler deals them) vs contiguous" in back["explanation"]
    bn = stage_chain(ref, _dealt_side(strided, hooks=True, act_shift=0.5), 1, 1e-10)
    assert bn["stage"] == "inputs" and "on matching rows the output of layer 0 differs" in bn["explanation"]
    same = stage_chain(ref, _dealt_side(contiguous, hooks=True), 1, 1e-10)
    assert same["stage"] is None and "different rows" not in same["explanation"], same["explanation"]
    other = _dealt_side(contiguous, hooks=True)
    other["device/rows"] = other["device/rows"] + 1.0  # other rows altogether: no matching, compared as before
    assert "different rows" not in stage_chain(ref, other, 1, 1e-10)["explanation"]


def test_a_logged_loss_gap_is_not_called_a_record_where_the_parameters_are_nan_on_both_sides():
    """Both runs NaN after step 1's update (Adam with epsilon 0 dividing 0 by 0): NaN on both sides is not
    agreement, so a loss gap at step 1 is not "what was logged" (the hunt's add_n_nograds vs torch.single, a
    predicted sum reduction that showed in the loss, was called "not the predicted difference")."""
    def nan_after_step_1(run: Trajectory) -> Trajectory:
        out = Trajectory(dict(run))
        for k in ("param/0.kernel", "grad/0.kernel", "state/1.moving_mean"):
            arr = np.array(run[k], np.float64)
            arr[1:] = np.nan  # parameters and state from row 1 (after step 1), gradients from step 2
            out[k] = arr
        return out

    a = nan_after_step_1(_run())
    b = nan_after_step_1(_run(loss_scale=lambda k: 3.0))
    where = localise(a, b, judge_float64(a, b))
    assert (where["first_bad_step"], where["stage"]) == (1, "loss"), where
    assert "not finite on both sides" in where["explanation"]
    # the premise: with finite parameters that agree, the same loss gap is what was logged
    assert _where(_run(loss_scale=lambda k: 3.0))["stage"] == "record"
