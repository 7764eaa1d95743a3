"""What a clean process costs per TensorFlow plugin run: three mechanisms measured (issue 26, item 1).

    .venv/bin/python benchmarks/bench_plugin_isolation.py [--repeat 5] [--plugin FILE.py:FN] [CASE]

Default: ``parity_tests/tests/plugins/fresh_state_tf.py:mirrored`` (a Keras model in a
``MirroredStrategy`` custom loop as the ``tf.distribute`` guide writes it, default
cross-device ops) on the ``examples/byo/keras-mirrored`` case, 10 steps, 4 replicas, float64. Each
mechanism runs the plugin ``--repeat`` times and prints every wall time of a run (from
asking to records back) and the median:

* ``in-process``: ``tfpar.plugin.run_plugin`` called again in this process (the tool
  before issue 26: no isolation at all; the plugin's state leaks). The first run also
  pays this process's TensorFlow runtime start and is shown apart.
* ``in-process + reset``: the same, preceded by the most complete reset TensorFlow and
  Keras offer (``keras.utils.clear_session(free_memory=True)``,
  ``tf.compat.v1.reset_default_graph()``, floatx / dtype policy / eager-function
  settings put back, the global seeds cleared). Printed: the reset's own time, and
  whether a second ``MirroredStrategy`` run in a float32/float64 alternation still fails
  after it (the collective instance keys live in the eager context, which no public
  call resets).
* ``fork``: ``parity_tests.running.tf_worker`` (what the tool does): a fresh process
  per run, forked from a server that imported TensorFlow once. The server's start
  (its TensorFlow import) is paid once and shown apart.
* ``spawn``: a fresh ``python`` per run that imports TensorFlow and runs the plugin
  (what a user would do by hand), for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPAWNED = """
import sys, time
t0 = time.perf_counter()
from parity_tests.running.backends import quiet_stderr
with quiet_stderr():
    import tensorflow, keras, tfpar
    tfpar.configure_devices({devices})
from parity_tests.contract.case import load_case
from tfpar.plugin import run_plugin
import importlib.util
path, _, attr = {plugin!r}.rpartition(":")
spec = importlib.util.spec_from_file_location("bench_plugin_spawned", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
case = load_case({case!r})
run_plugin(getattr(module, attr), case.payload())
print(time.perf_counter() - t0)
"""


def _median(ts: list[float]) -> str:
    return f"median {statistics.median(ts):.2f} s ({', '.join(f'{t:.2f}' for t in ts)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", nargs="?", default="examples/byo/keras-mirrored/case.json")
    p.add_argument("--plugin", default="parity_tests/tests/plugins/fresh_state_tf.py:mirrored")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    os.chdir(ROOT)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from parity_tests.contract.case import load_case
    from parity_tests.running import backends
    from parity_tests.running.tf_worker import TFWorker

    case = load_case(args.case)
    devices = 64

    # fork: the server starts first, so that its import is not shared with this process's
    worker = TFWorker()
    t0 = time.perf_counter()
    worker.start()
    job = None
    try:
        from parity_tests.protocol.rows import spill_threshold

        job = {"cwd": os.getcwd(), "environ": dict(os.environ), "sys_path": list(sys.path),
               "spill_bytes": spill_threshold(), "devices": devices, "payload": case.payload(), "deterministic": True}
        plugin_path, _, attr = args.plugin.rpartition(":")
        path = str(Path(plugin_path).resolve())
        job["location"] = {"path": path, "module_name": "bench_plugin", "attr": attr}
        first = worker.run(job)
        assert "records" in first, first
        start = time.perf_counter() - t0
        forked = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            out = worker.run(job)
            assert "records" in out, out
            forked.append(time.perf_counter() - t)
    finally:
        worker.close()
    print(f"fork: server start + first run {start:.2f} s; each later run {_median(forked)}")

    spawned = []
    code = SPAWNED.format(devices=devices, case=args.case, plugin=args.plugin)
    for _ in range(args.repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        spawned.append(time.perf_counter() - t)
    print(f"spawn: each run (python start, TensorFlow import, run) {_median(spawned)}")

    backends.tf_module()
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_plugin_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # in this process: what the tool did before issue 26
    fn = getattr(module, attr)
    from tfpar.plugin import run_plugin

    t = time.perf_counter()
    run_plugin(fn, case.payload())
    print(f"in-process: first run (this process's runtime start) {time.perf_counter() - t:.2f} s")
    inproc = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        run_plugin(fn, case.payload())
        inproc.append(time.perf_counter() - t)
    print(f"in-process: each later run {_median(inproc)}")

    import keras
    import tensorflow as tf

    def reset() -> None:
        keras.utils.clear_session(free_memory=True)
        tf.compat.v1.reset_default_graph()
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
        tf.config.run_functions_eagerly(False)
        tf.random.set_seed(None)

    resets, runs = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        reset()
        resets.append(time.perf_counter() - t)
        t = time.perf_counter()
        run_plugin(fn, case.payload())
        runs.append(time.perf_counter() - t)
    print(f"in-process + reset: the reset {_median(resets)}; the run after it {_median(runs)}")
    other = case.replace(dtype="float32" if case.spec["dtype"] == "float64" else "float64")
    reset()
    try:
        run_plugin(fn, other.payload())
        print(f"in-process + reset: a {other.spec['dtype']} run after the {case.spec['dtype']} runs: ran")
    except Exception as e:  # noqa: BLE001
        print(f"in-process + reset: a {other.spec['dtype']} run after the {case.spec['dtype']} runs: FAILED"
              f" ({str(e).splitlines()[-1][:160]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
