""".venv/bin/python benchmarks/bench_world.py [--counts 1,2,4,8,16,32,64] [--steps 10]

Cost per step against the device count N for ``tf.towers`` (N logical devices in this process) and
``torch.ddp`` (N gloo ranks of the warm pool), on the 5-10-1 MLP with 4 rows a device (float64, SGD).
A run of 2 steps and a run of 2 + ``--steps`` steps are timed; their difference over ``--steps`` is the
cost of one step, without the set-up both pay once (tracing the N-tower step, wrapping the model in
DDP). ``tf.towers``' two timed runs reuse the trainer of a warm-up run (``tfpar.reuse``), so neither
traces: before that reuse their difference was the noise of two traces of N towers (0.0 ms/step
printed at N = 16 and 64). Its set-up column is a run of 2 steps that builds and traces its own
trainer (``TFPAR_TRACE_CACHE=0``). Also printed: the pool's start-up at the largest N and each rank's memory (psutil USS), measured
before any job. Prints a markdown table (docs/large-world.md holds one).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MLP = {
    "schema": "parity-case/1", "name": "bench-world", "dtype": "float64",
    "model": {"input_shape": [5], "layers": [{"type": "dense", "units": 10, "activation": "relu"},
                                             {"type": "dense", "units": 1}], "loss": "sigmoid_ce"},
    "init": {"seed": 4, "kind": "normal", "stddev": 0.5},
    "data": {"generator": "binary5", "seed": 3, "global_batch": 4},
    "optimizer": {"name": "sgd", "lr": 0.01, "semantics": "torch"},
    "parallel": {"devices": 1},
    "steps": 2,
}


def _timed(case, impl: str, *, traced: bool = False) -> float:
    """Wall seconds of one run; ``traced``: with trainer reuse off (``tf.towers`` builds and traces)."""
    from parity_tests.running.harness import run_impl

    off = contextlib.nullcontext()
    if traced:
        from tfpar.reuse import disabled

        off = disabled()
    with off:
        t = time.perf_counter()
        run_impl(case, impl)
        return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="1,2,4,8,16,32,64", help="device counts N (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="extra steps timed per N (default: %(default)s)")
    args = p.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    extra = args.steps

    import psutil

    from parity_tests.contract.case import case_from_dict, with_changes
    from parity_tests.running.backends import check_torch_ranks, reserve_tf_devices, tf_module
    from torchref.pool import get_pool, shutdown_pool

    top = max(counts)
    check_torch_ranks(top)  # one line and exit 2 (below) where this machine cannot hold the ranks
    reserve_tf_devices(top)
    tf_module()
    t = time.perf_counter()
    pool = get_pool(top, timeout=300.0)
    pool.start()
    start_s = time.perf_counter() - t
    uss = [psutil.Process(pid).memory_full_info().uss / 2**20 for pid in pool.pids]
    print(f"pool start-up, {top} ranks: {start_s:.1f} s; memory per rank (USS) {statistics.mean(uss):.0f} MiB "
          f"(max {max(uss):.0f}), {sum(uss) / 1024:.1f} GiB in all", flush=True)
    print("\n| N | tf.towers ms/step | tf.towers set-up s | torch.ddp ms/step | torch.ddp set-up s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    try:
        for n in counts:
            row = [str(n)]
            for impl in ("tf.towers", "torch.ddp"):
                sized = {"parallel.devices": n, "data.global_batch": 4 * n}
                short = case_from_dict(with_changes(MLP, **sized))
                long = case_from_dict(with_changes(MLP, **sized, steps=2 + extra))
                _timed(short, impl)  # warm-up: first use of this N (subgroup, thread pools; tf.towers' trainer)
                t_short, t_long = _timed(short, impl), _timed(long, impl)
                t_setup = _timed(short, impl, traced=True) if impl == "tf.towers" else t_short
                row += [f"{max(0.0, t_long - t_short) / extra * 1e3:.1f}", f"{t_setup:.2f}"]
            print("| " + " | ".join(row) + " |", flush=True)
    finally:
        shutdown_pool()


if __name__ == "__main__":
    from parity_tests.protocol.errors import CaseError

    try:
        main()
    except CaseError as e:
        print(f"bench_world: {e}", file=sys.stderr)
        sys.exit(2)
