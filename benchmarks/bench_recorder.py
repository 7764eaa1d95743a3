"""What recording costs a built-in run of a GPT (issue 38): the recorder alone, CPU seconds per step.

    .venv/bin/python benchmarks/bench_recorder.py                     # the 29.5 M GPT, float64, 3 steps
    .venv/bin/python benchmarks/bench_recorder.py --model gpt2-small --dtype float32

Every built-in engine records, after each step, every parameter and the gradient it applied
(``protocol.recorder.Recorder``): two copies of the model a step, which past ``TFPAR_SPILL_BYTES``
go to spill files row by row, each row's infinity norm and finiteness computed as it is written
(``protocol.rows``). This script records a trajectory of the model's parameter shapes (those of
``examples/architectures/<model>``: embedding, position embedding, per block two layer norms, the
attention's query/key/value/output kernels and biases, the MLP's two dense layers, the final layer
norm) from arrays already in memory, as an engine hands over its copies, and prints the CPU seconds
(user + system, this process: the copies into the page cache included) of the first row and of each
step, and the wall time beside them. The engines' own copies out of TensorFlow or torch are not in it.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_gpt import CONFIGS  # this folder is first on sys.path when run as a script

from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.rows import ensure_spill_root, remove_spill_root


def shapes(model: str) -> list[tuple[int, ...]]:
    """The parameter shapes of ``model`` (``bench_gpt.CONFIGS``), in the order the case builds them."""
    vocab, ctx, width, layers, heads, _ = CONFIGS[model]
    key = width // heads
    out: list[tuple[int, ...]] = [(vocab, width), (ctx, width)]
    for _ in range(layers):
        out += [(width,), (width,)]  # layer norm
        out += [(width, heads, key), (heads, key)] * 3 + [(heads, key, width), (width,)]  # attention
        out += [(width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]  # norm, MLP
    return out + [(width,), (width,)]


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="gpt-29m")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    params = {f"p{i}": rng.standard_normal(s).astype(args.dtype) for i, s in enumerate(shapes(args.model))}
    grads = {k: v * 0.5 for k, v in params.items()}
    size = sum(v.size for v in params.values())
    print(f"{args.model}, {args.dtype}: {size / 1e6:.2f} M parameters, {2 * size * params['p0'].itemsize / 1e9:.2f} GB"
          f" recorded a step (parameters and gradients); load average {os.getloadavg()[0]:.2f}", flush=True)
    ensure_spill_root()
    try:
        c0, w0 = cpu(), time.perf_counter()
        rec = Recorder(iter(params.items()))
        print(f"  row 0 (the initial values): {cpu() - c0:.2f} CPU s, {time.perf_counter() - w0:.2f} s wall")
        for k in range(1, args.steps + 1):
            c0, w0 = cpu(), time.perf_counter()
            rec.loss(np.float64(k))
            for name in params:
                rec.grad(name, grads[name])
                rec.param(name, params[name])
            print(f"  step {k}: {cpu() - c0:.2f} CPU s, {time.perf_counter() - w0:.2f} s wall", flush=True)
        c0 = cpu()
        traj = rec.finish()
        print(f"  finish: {cpu() - c0:.2f} CPU s; {len(traj)} arrays")
        del traj, rec
    finally:
        remove_spill_root()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
