"""Real model sizes (issue 11): peak resident memory of every process and wall time of ``tfpar compare``.

    .venv/bin/python benchmarks/bench_scale.py                      # 25 M parameters, 20 steps, 4 devices
    .venv/bin/python benchmarks/bench_scale.py --params 100 --steps 5
    .venv/bin/python benchmarks/bench_scale.py --params 6.3 --no-alone

For a dense model of about ``--params`` million parameters (1024 inputs, two hidden layers
of width w, 10 classes, softmax, momentum SGD, float32), it prints

* the compare: ``tfpar compare CASE --impls tf.towers,torch.ddp`` in a fresh process, its wall
  time and the peak resident memory (``VmHWM``) of the main process and of every torch worker,
  sampled from ``/proc`` every 0.2 s (the peak is the kernel's own high-water mark, so sampling
  misses nothing but a process that ends between two samples);
* the work alone: the same four runs the compare makes (float32 and float64 on each side),
  each timed from its first training step to its last inside the implementation (one
  ``tfpar run`` per run, the time its progress reports; imports, model build and pool start are
  excluded) -- the compare's ratio to it is issue 11's "within 2x of the work itself".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _width(params_m: float) -> int:
    """Hidden width w with 1024 w + w^2 + 10 w ~ params (two hidden layers of w)."""
    p = params_m * 1e6
    return int((-1034 + (1034**2 + 4 * p) ** 0.5) / 2)


def make_case(folder: Path, params_m: float, steps: int, devices: int, batch: int) -> tuple[Path, int]:
    w = _width(params_m)
    case = {
        "schema": "parity-case/1", "name": f"scale-{params_m:g}M", "dtype": "float32",
        "model": {"input_shape": [1024], "layers": [
            {"type": "dense", "units": w, "activation": "relu"},
            {"type": "dense", "units": w, "activation": "relu"},
            {"type": "dense", "units": 10}], "loss": "softmax_ce", "reduction": "mean"},
        "init": {"seed": 3},
        "data": {"generator": "blobs", "seed": 1, "global_batch": batch},
        "optimizer": {"name": "momentum", "lr": 0.001, "momentum": 0.9},
        "parallel": {"devices": devices, "combine": "grad_mean", "shard": "contiguous", "weighting": "equal"},
        "steps": steps,
    }
    path = folder / "case.json"
    path.write_text(json.dumps(case, indent=1))
    n = 1024 * w + w + w * w + w + w * 10 + 10
    return path, n


def _pss(pid: int) -> int:
    """Proportional set size (bytes): a forked child's pages shared with its parent counted once, split."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def _role(p: psutil.Process) -> str:
    """What a process of the compare's tree is, from its command line and its parent's."""
    line = " ".join(p.cmdline())
    parent = " ".join(p.parent().cmdline()) if p.parent() is not None else ""
    if "tf_worker" in line:  # the TensorFlow server, and the children it forks (one per large run)
        return "TensorFlow child (forked by the server)" if "tf_worker" in parent else "TensorFlow server"
    if "forkserver" in line:  # torch's pool: the forkserver, and the ranks it forks
        return "torch rank (forked by the forkserver)" if "forkserver" in parent else "torch forkserver"
    return " ".join(p.cmdline()[1:3])[:40]


#: the last :func:`watch`'s whole-tree figures: the greatest sum of the processes' PSS at one sample, the
#: least memory the machine had available, and whether the guard stopped the command
LAST_TREE: dict[str, float] = {}


#: the last :func:`watch`'s greatest proportional set size (PSS, bytes) of each process, by pid, beside the
#: resident peaks it returns: a forked child's pages shared with its parent (the TensorFlow server's, the
#: forkserver's) count once, split between them, where each one's resident set counts them whole
LAST_PSS: dict[int, int] = {}
#: the last :func:`watch`'s CPU seconds (user + system, the process's own) of each process at its last sample:
#: summed, the tree's CPU time, short by at most one 0.2 s interval per process
LAST_CPU: dict[int, float] = {}


def watch(cmd: list[str], env: dict[str, str] | None = None, *,
          floor_bytes: int = 0) -> tuple[float, dict[int, tuple[str, int]], int, str]:
    """Run ``cmd``; ``(wall seconds, {pid: (role, peak resident bytes)}, exit status, output tail)``.

    Every process of the tree (the main process, its children and theirs: TensorFlow children,
    torch ranks, the forkserver) is sampled every 0.2 s: its resident high-water mark (``VmHWM``,
    the kernel's own maximum, so nothing is missed between samples) and its PSS (sampled: a peak
    shorter than 0.2 s can be missed), whose per-process maxima go to :data:`LAST_PSS`.
    ``floor_bytes``: stop the whole process tree (SIGKILL to its session) when the machine's
    available memory falls under it, before the kernel's OOM killer picks a process of its own.
    The tree's greatest summed PSS at one sample and the least available memory go to ``LAST_TREE``.
    """
    import signal
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    peaks: dict[int, tuple[str, int]] = {}
    LAST_PSS.clear()
    LAST_CPU.clear()
    main = psutil.Process(proc.pid)
    out: list[str] = []
    tree_peak, least_available, stopped = 0, psutil.virtual_memory().available, False

    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            procs = [main, *main.children(recursive=True)]
        except psutil.Error:
            procs = []
        tree = 0
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
                role = peaks[p.pid][0] if p.pid in peaks else "main" if p.pid == proc.pid else _role(p)
                pss = _pss(p.pid)
                cpu = p.cpu_times()
            except (OSError, StopIteration, psutil.Error):
                continue
            tree += pss
            LAST_PSS[p.pid] = max(pss, LAST_PSS.get(p.pid, 0))
            LAST_CPU[p.pid] = cpu.user + cpu.system
            peaks[p.pid] = (role, max(hwm, peaks.get(p.pid, ("", 0))[1]))
        tree_peak = max(tree_peak, tree)
        available = psutil.virtual_memory().available
        least_available = min(least_available, available)
        if floor_bytes and available < floor_bytes and not stopped:
            stopped = True
            out.append(f"\n[watch] available memory {available / 1e9:.2f} GB < {floor_bytes / 1e9:.2f} GB: stopped\n")
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    reader.join(timeout=5)
    LAST_TREE.update(tree_peak=tree_peak, least_available=least_available, stopped=float(stopped))
    return time.perf_counter() - t0, peaks, proc.returncode, "".join(out)[-3000:]


_ALONE = r"""
import json, sys, time
sys.path.insert(0, {root!r})
from parity_tests.contract.case import load_case
from parity_tests.running.harness import run_impl, prestart_torch
case = load_case({case!r})
impl = {impl!r}
if impl.startswith("torch"):
    prestart_torch(case, [impl])
    run_impl(case.replace(steps=1), impl)  # the pool started and warm, untimed
for dtype in ("float32", "float64"):
    c = case.replace(dtype=dtype)
    marks = []
    t0 = time.perf_counter()
    traj = run_impl(c, impl, progress=lambda k: marks.append(time.perf_counter()))
    t1 = time.perf_counter()
    # TensorFlow reports every step: from the end of step 1 to the end of the last, scaled to all steps;
    # the torch pool reports once at the end: the whole job (the pool already warm)
    steps = c.spec["steps"]
    took = (marks[-1] - marks[0]) * steps / (steps - 1) if len(marks) > 1 else t1 - t0
    print(json.dumps({{"impl": impl, "dtype": dtype, "seconds": took}}), flush=True)
    del traj
"""


def alone(case: Path, impl: str) -> list[dict]:
    code = _ALONE.format(root=str(ROOT), case=str(case), impl=impl)
    out = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{impl} alone failed:\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=25.0, help="millions of parameters (default 25)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    ap.add_argument("--impls", default="tf.towers,torch.ddp")
    ap.add_argument("--no-alone", action="store_true", help="skip timing the runs alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        case, n = make_case(Path(tmp), args.params, args.steps, args.devices, args.batch)
        print(f"model: {n / 1e6:.1f} M parameters (1024-{_width(args.params)}-{_width(args.params)}-10), "
              f"{args.steps} steps, {args.devices} devices, float32 case, impls {args.impls}", flush=True)
        wall, peaks, rc, tail = watch([PY, "-m", "parity_tests.cli", "compare", str(case), "--impls", args.impls],
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(tail.strip().splitlines()[-1] if tail.strip() else "(no output)")
        print(f"compare: exit {rc}, {wall:.1f} s wall")
        for pid, (role, peak) in sorted(peaks.items(), key=lambda kv: -kv[1][1]):
            if peak > 200e6:
                print(f"  peak resident {peak / 1e9:6.2f} GB  pid {pid} {role}")
        main_peak = max((p for r, p in peaks.values() if r == "main"), default=0)
        print(f"  greatest peak in any process: {max(p for _, p in peaks.values()) / 1e9:.2f} GB "
              f"(main {main_peak / 1e9:.2f} GB)")
        if rc != 0:
            print(tail)
        if not args.no_alone:
            total = 0.0
            for impl in args.impls.split(","):
                for r in alone(case, impl):
                    total += r["seconds"]
                    print(f"  alone: {r['impl']} {r['dtype']}: {r['seconds']:.1f} s of training steps")
            print(f"work alone (four runs, one after another): {total:.1f} s; compare / alone = {wall / total:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
