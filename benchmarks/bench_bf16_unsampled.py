""".venv/bin/python benchmarks/bench_bf16_unsampled.py PAIR.json [PAIR.json ...]

Which bfloat16 roundings of a mixed pair no rerun re-samples (the bfloat16 rule, judging.bfloat16).

For each ``pair.json`` an error-rate hunt wrote (``bench_error_rates.py``), re-judges the pair and
prints, per side, at the array and step where the rule's side check is tightest: the side's
distance from its float64 run ``D = X - X64``, the part beyond the error both sides share, the
bound ``E`` and how much of ``D`` each perturbed rerun repeats (``1 - |D - D'| / |D|``: near 1, the
rerun made the same rounding, so the spread ``S`` cannot hold it).

Where a torch side runs a model the emulation covers (dense layers without activation, softmax
cross-entropy, 1 step), the side's step-1 gradient is recomputed in numpy with torch's CPU autocast
recipe (``torchref``: rank ``r`` backpropagates ``s_r = N w_r`` times its loss, ``F.linear`` rounds its
output, its weight and bias gradients and its input gradient once each, DDP sums the ranks' float32
gradients and divides by ``N``), checked against the run, then again with one kind of rounding left
out at a time: the loss's gradient at the logits (``g = s_r dl_r/dz``, cast to bfloat16 by the
backward of the loss's ``float()``), and each device's gradient result (its weight and bias
gradients, rounded to bfloat16 before the float32 sum over devices). It prints each kind's share of
the gradient's error (and, for the last line, a float64 computation that rounds only ``g`` and each device's
gradient: what a float64 run rounding them would measure); one bfloat16 rounding (2^-8 relative) of each device's gradient and of each row's
term, summed (``sum |G_dev|``, ``sum |G_row|``: what those roundings can reach where the terms cancel),
against one rounding of the whole gradient; and per device the scale ``s_r`` at which it rounds ``g``
(two sides round the same ``g`` alike only when their scales are a power of 2 apart) and how far one
bfloat16 ulp of every input moves ``g`` against ``g``'s own bfloat16 step. docs/error-rates.md, "the
bfloat16 rule's pairs 432 and 896", has its figures for seed 1's two false alarms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def _bf(a) -> np.ndarray:
    """Round to bfloat16 (to nearest, ties to even, as both frameworks do), back in float64."""
    a = np.asarray(a, np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _f32(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float64)


def _ulp_bf(v) -> np.ndarray:
    return 2.0 ** (np.floor(np.log2(np.abs(np.asarray(v, np.float64)) + 1e-300)) - 7)


def _txt(a) -> str:
    return np.array2string(np.asarray(a).ravel()[:6], formatter={"float_kind": lambda v: f"{v:.2e}"})


def _emulatable(raw: dict) -> bool:
    m = raw["model"]
    return (raw["steps"] >= 1 and m["loss"] == "softmax_ce" and all(
        ly["type"] == "dense" and ly.get("activation", "none") == "none" for ly in m["layers"])
        and raw["parallel"].get("accumulate", 1) == 1 and "clip" not in raw["optimizer"]
        and not raw["data"].get("sample_weights"))


def _torch_step1(case, devices: int, *, round_g: bool = True, round_result: bool = True, round_rest: bool = True,
                 x_moved: np.ndarray | None = None) -> tuple[dict, list, dict, dict]:
    """The step-1 combined gradient of torch's recipe on ``devices`` ranks (module docstring); per rank its
    scale ``s_r``, rows and loss gradient ``g`` (float64, before its rounding); per array ``sum_r |G_r| / N``
    over the devices' gradients and ``sum_i |G_i| / N`` over the rows' terms. ``round_*``: which roundings it
    makes; ``x_moved``: the inputs in place of the case's."""
    from parity_tests.protocol.shards import shard_rows

    raw = case.spec
    batch, par = raw["data"]["global_batch"], raw["parallel"]
    x, y = np.asarray(case.x if x_moved is None else x_moved, np.float64)[:batch], np.asarray(case.y)[:batch]
    layers = raw["model"]["layers"]
    names = [(f"{i}.kernel", f"{i}.bias" if ly.get("use_bias", True) else None) for i, ly in enumerate(layers)]
    rest = _bf if round_rest else (lambda v: np.asarray(v, np.float64))
    res = _bf if round_result else (lambda v: np.asarray(v, np.float64))
    ws = [(rest(case.init[k]), None if b is None else rest(case.init[b])) for k, b in names]
    rows = [list(shard_rows(batch, devices, q, par["shard"])) for q in range(devices)] if devices > 1 else [list(range(batch))]
    sizes = [len(r) for r in rows]
    w = ([1.0 / devices] * devices if par["weighting"] == "equal" or devices == 1 else [1.0] * devices
         if par["weighting"] == "sum" else [s / batch for s in sizes])
    total: dict[str, np.ndarray] = {}
    by_device: dict[str, np.ndarray] = {}
    by_row: dict[str, np.ndarray] = {}
    info = []
    for r, ix in enumerate(rows):
        if not ix:
            continue
        s = devices * w[r] if (par["combine"] == "loss_mean" or par["weighting"] != "equal") and devices > 1 else 1.0
        h = [rest(x[ix])]
        for wk, wb in ws:
            h.append(rest(h[-1] @ wk + (0.0 if wb is None else wb)))  # F.linear: the bias inside, one rounding
        z = h[-1]
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = s * (p - np.eye(z.shape[1])[y[ix]]) / (len(ix) if raw["model"]["reduction"] == "mean" else 1.0)
        info.append((r, s, ix, g))
        d = _bf(_f32(g)) if round_g else g
        for li in range(len(names) - 1, -1, -1):
            k, b = names[li]
            total[k] = total.get(k, 0.0) + _f32(res(h[li].T @ d)) / devices  # DDP: the float32 sum over ranks / N
            by_device[k] = by_device.get(k, 0.0) + np.abs(h[li].T @ d) / devices
            by_row[k] = by_row.get(k, 0.0) + np.abs(h[li][:, :, None] * d[:, None, :]).sum(0) / devices
            if b is not None:
                total[b] = total.get(b, 0.0) + _f32(res(d.sum(0))) / devices
                by_device[b] = by_device.get(b, 0.0) + np.abs(d.sum(0)) / devices
                by_row[b] = by_row.get(b, 0.0) + np.abs(d).sum(0) / devices
            if li:
                d = rest(d @ ws[li][0].T)
    return total, info, by_device, by_row


def _emulate(case, side, devices: int, key: str) -> None:
    name = key.split("/", 1)[1]
    recorded, exact64 = np.asarray(side.run[f"grad/{name}"], np.float64)[0], np.asarray(side.float64[f"grad/{name}"])[0]
    full, info, _, _ = _torch_step1(case, devices)
    exact, _, by_device, by_row = _torch_step1(case, devices, round_g=False, round_result=False, round_rest=False)
    off = float(np.abs(full[name] - recorded).max())
    print(f"    emulation of {side.name}'s step-1 gradient of {name}: {off:.1e} from the run"
          f" (exact part {float(np.abs(exact[name] - exact64).max()):.1e} from its float64 run)")
    if off > 1e-6 * max(float(np.abs(recorded).max()), 1e-30):
        print("    (not the run's arithmetic: no decomposition)")
        return
    err = full[name] - exact[name]
    norm = float(np.linalg.norm(exact[name]))
    print(f"    its error {_txt(err)} (relative {np.linalg.norm(err) / norm:.2e}); one bfloat16 rounding"
          f" (2^-8 relative) of each device's gradient: {np.linalg.norm(by_device[name]) / 256 / norm:.2e}, of each"
          f" row's term: {np.linalg.norm(by_row[name]) / 256 / norm:.2e}; of the whole gradient: {1 / 256:.2e}")
    for label, kw in (("the loss gradient g rounded", dict(round_result=False, round_rest=False)),
                      ("each device's gradient result rounded", dict(round_g=False, round_rest=False)),
                      ("every other rounding", dict(round_g=False, round_result=False)),
                      ("all but g's rounding", dict(round_g=False)),
                      ("g and each device's gradient rounded", dict(round_rest=False))):
        e = _torch_step1(case, devices, **kw)[0][name] - exact[name]
        print(f"      {label:42s} alone: relative {np.linalg.norm(e) / norm:.2e}"
              f" (the rest of the error: {np.linalg.norm(err - e) / norm:.2e})")
    # one bfloat16 ulp of every input, up (a rerun moves each by one, with its own coins): how far that moves g
    xb = _bf(np.asarray(case.x, np.float64))
    _, moved, _, _ = _torch_step1(case, devices, x_moved=xb + _ulp_bf(xb))
    print("      per device: scale s_r at which it rounds g, rows, |g| max, g's bfloat16 step there, |g' - g| max"
          " with every input moved by one bfloat16 ulp")
    for (r, s, ix, g), (_, _, _, g2) in zip(info, moved, strict=True):
        gm = float(np.abs(g).max())
        print(f"        rank {r}: s {s:.4g}, {len(ix)} rows, |g| {gm:.3g}, step {float(_ulp_bf(gm)):.1e},"
              f" move {float(np.abs(g2 - g).max()):.1e}")


def _diagnose(path: Path) -> None:
    import parity_tests.judging.bfloat16 as b16
    from parity_tests.judging.gaps import _gaps, _judged_keys, _row_max, _scales
    from parity_tests.session.comparison import compare_case
    from parity_tests.tests.hunt.corpus import BUGS, Pair, mutated_runner

    d = json.loads(path.read_text())
    bug = None
    if d.get("bug"):
        bug = next(b for b in BUGS if b.name == d["bug"] and d["bug_impl"] in (b.impl, b.base))
    pair = Pair(d["raw"], d["reference"], bug.impl if bug else d["impl"], bug)
    seen: list = []
    real = b16.judge_bfloat16

    def spy(a, b, **kw):
        seen.append((a, b))
        return real(a, b, **kw)

    b16.judge_bfloat16 = spy
    try:
        result = compare_case(pair.case(), [pair.reference, pair.impl], runner=mutated_runner(bug), stages=False,
                              skip_unsupported=True)
    finally:
        b16.judge_bfloat16 = real
    v = result.pairs[0].verdict
    print(f"{path}: {pair.reference} vs {pair.impl}: {v.status} ({v.rule}), gap {v.gap:.3g}, bound {v.bound:.3g}")
    if not seen:
        return
    a, b = seen[0]
    keys = _judged_keys([a.run, b.run, a.float64, b.float64], None)
    scales = _scales(a.float64, b.float64, keys)
    errs = {s.name: {k: np.asarray(s.run[k], np.float64) - np.asarray(s.float64[k]) for k in keys} for s in (a, b)}
    own_a, own_b, shared = b16._beyond_shared(errs[a.name], errs[b.name], keys)
    for s, own in ((a, own_a), (b, own_b)):
        beyond, arg = _row_max(_gaps(own, b16._zeros(own), keys, scales))
        row = int(np.nanargmax(beyond))
        key = keys[int(arg[row])]
        e = errs[s.name][key][row]
        reps = []
        for r, r64 in zip(s.reruns, s.reruns64, strict=True):
            e2 = np.asarray(r[key], np.float64)[row] - np.asarray(r64[key], np.float64)[row]
            reps.append(1.0 - float(np.linalg.norm(e - e2) / max(np.linalg.norm(e), 1e-300)))
        print(f"  {s.name}: beyond the shared error {beyond[row]:.2e} at step {row} ({key}); its error there"
              f" {_txt(e)}; the reruns repeat {', '.join(f'{x:.0%}' for x in reps)} of it")
        impl = registry_framework(s.name)
        if impl == "torch" and _emulatable(pair.raw) and key.startswith("param/"):
            devices = pair.raw["parallel"]["devices"] if s.name.endswith(".ddp") else 1
            _emulate(pair.case(), s, devices, key)


def registry_framework(name: str) -> str:
    from parity_tests.running import registry

    return registry.resolve(name, "impls").framework


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("pairs", nargs="+", type=Path, help="pair.json files an error-rate hunt wrote")
    args = ap.parse_args()
    from parity_tests.running.backends import reserve_tf_devices

    reserve_tf_devices(8)
    from torchref.pool import shutdown_pool

    try:
        for p in args.pairs:
            _diagnose(p)
    finally:
        shutdown_pool()


if __name__ == "__main__":
    main()
