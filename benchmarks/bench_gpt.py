"""A GPT-style decoder at real size (issue 27 item 5): ``tfpar compare`` against the same training done plainly.

    .venv/bin/python benchmarks/bench_gpt.py                          # the 29.5 M GPT: compare + plain runs
    .venv/bin/python benchmarks/bench_gpt.py --plain-only             # the plain Keras / torch runs alone
    .venv/bin/python benchmarks/bench_gpt.py --model gpt2-small --seq 128 --steps 2 --no-plain
    .venv/bin/python benchmarks/bench_gpt.py --profile                # where the main process's memory goes
    .venv/bin/python benchmarks/bench_gpt.py --no-plain --no-capture  # the compare without its capture runs

The model is ``examples/architectures/<model>/case.json`` (``gpt-29m``: vocabulary 8192, context
256, width 512, 8 pre-LN blocks of 8 heads, tied embeddings; ``gpt2-small``: 50257, 1024, 768, 12,
12), trained with Adam (lr 1e-3, each framework's own) on ``--batch`` sequences of ``--seq`` tokens
for ``--steps`` steps. It prints

* the compare: ``tfpar compare CASE --impls tf.towers,torch.ddp`` (float32 case, ``--devices``
  devices) in a fresh process: wall time, verdict line, and for every process of its tree (the
  main process, the TensorFlow server and the children it forks, the torch forkserver and its
  ranks) the greatest proportional set size (PSS: pages a forked child shares with its parent
  counted once, split between them; sampled every 0.2 s) with the maximum resident set beside it
  (``VmHWM``, the kernel's high-water mark), and the whole tree's greatest PSS at one sample;
* the runs per compare: every run the compare made (its default runner counted where it calls
  ``harness.run_impl``; nothing else changes), by implementation, dtype, mapped or not (the
  sections of the case the mapping changed) and capture run or training, with its time;
* the plain runs: the same model, batch and steps written plainly -- Keras (``Embedding``,
  ``MultiHeadAttention(use_causal_mask=True)``, ``LayerNormalization``, ``Dense``, ``Add``, the
  logits ``h @ embeddings.T``, ``SparseCategoricalCrossentropy``, ``Adam``, ``train_on_batch``) and
  torch (``nn.Embedding``, ``nn.MultiheadAttention(batch_first=True)`` with a causal mask,
  ``nn.LayerNorm``, ``nn.Linear``, ``F.cross_entropy``, ``torch.optim.Adam``) -- in float32 and
  float64 (the dtypes a float32 verdict needs: ``docs/tolerance.md``), one process each, one
  device, the whole batch. Each prints its process wall time (start to exit: imports, build,
  the first step's tracing included), the time of its training steps, and its peak resident memory.

The ratio printed is the compare's wall time over the sum of the four plain processes' wall times
(the compare does those four trainings and more); the training-steps-only sum is printed too.
Token ids of the plain runs are uniform draws (the time of a step does not depend on their values).
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
from bench_scale import (  # this folder is first on sys.path when run as a script
    LAST_CPU,
    LAST_PSS,
    LAST_TREE,
    watch,
)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

CONFIGS = {  # vocabulary, context, width, layers, heads, GELU (examples/architectures/README.md)
    "gpt-29m": (8192, 256, 512, 8, 8, "gelu"),
    "gpt2-small": (50257, 1024, 768, 12, 12, "gelu_tanh"),
}

_KERAS = r"""
import json, os, sys, time
t_start = time.perf_counter()
import numpy as np
import keras
from keras import layers, ops
V, T_CTX, D, L, H, GELU, dtype, steps, batch, seq = {args!r}
keras.config.set_floatx(dtype)

class PositionEmbedding(layers.Layer):
    def build(self, shape):
        self.embeddings = self.add_weight(shape=(T_CTX, D), initializer="random_normal", name="embeddings")
    def call(self, x):
        return x + self.embeddings[: ops.shape(x)[1]]

class TiedLogits(layers.Layer):
    def __init__(self, embedding, **kw):
        super().__init__(**kw)
        self.embedding = embedding
    def call(self, h):
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))

gelu = "gelu" if GELU == "gelu" else (lambda x: keras.activations.gelu(x, approximate=True))
ids = keras.Input((seq,), dtype="int32")
emb = layers.Embedding(V, D)
h = PositionEmbedding()(emb(ids))
for _ in range(L):
    a = layers.LayerNormalization(epsilon=1e-5)(h)
    a = layers.MultiHeadAttention(num_heads=H, key_dim=D // H)(a, a, use_causal_mask=True)
    h = layers.Add()([h, a])
    m = layers.LayerNormalization(epsilon=1e-5)(h)
    m = layers.Dense(D, activation=None)(layers.Dense(4 * D, activation=gelu)(m))
    h = layers.Add()([h, m])
logits = TiedLogits(emb)(layers.LayerNormalization(epsilon=1e-5)(h))
model = keras.Model(ids, logits)
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.integers(0, V, size=(steps, batch, seq)).astype("int32")
y = rng.integers(0, V, size=(steps, batch, seq)).astype("int32")
marks = [time.perf_counter()]
for k in range(steps):
    loss = model.train_on_batch(x[k], y[k])
    marks.append(time.perf_counter())
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({{"params": int(model.count_params()), "steps_s": marks[-1] - marks[0],
                  "after_first_s": marks[-1] - marks[1], "peak": hwm, "loss": float(loss),
                  "to_first_step_s": marks[0] - t_start}}), flush=True)
"""

_TORCH = r"""
import json, time
t_start = time.perf_counter()
import numpy as np
import torch
from torch import nn
import torch.nn.functional as F
V, T_CTX, D, L, H, GELU, dtype, steps, batch, seq = {args!r}
torch.set_default_dtype(getattr(torch, dtype))
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D, eps=1e-5), nn.LayerNorm(D, eps=1e-5)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.approx = "none" if GELU == "gelu" else "tanh"
    def forward(self, x, mask):
        a = self.ln1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approx))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        nn.init.normal_(self.emb.weight, std=0.02)  # nanoGPT's (the default N(0, 1) makes tied logits ~ sqrt(D))
        self.pos = nn.Parameter(torch.randn(T_CTX, D) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln = nn.LayerNorm(D, eps=1e-5)
    def forward(self, ids):
        t = ids.shape[1]
        x = self.emb(ids) + self.pos[:t]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        for b in self.blocks:
            x = b(x, mask)
        return F.linear(self.ln(x), self.emb.weight)

model = GPT()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
rng = np.random.default_rng(0)
x = torch.from_numpy(rng.integers(0, V, size=(steps, batch, seq)))
y = torch.from_numpy(rng.integers(0, V, size=(steps, batch, seq)))
marks = [time.perf_counter()]
for k in range(steps):
    opt.zero_grad()
    loss = F.cross_entropy(model(x[k]).reshape(-1, V), y[k].reshape(-1))
    loss.backward()
    opt.step()
    marks.append(time.perf_counter())
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({{"params": sum(p.numel() for p in model.parameters()), "steps_s": marks[-1] - marks[0],
                  "after_first_s": marks[-1] - marks[1], "peak": hwm, "loss": float(loss),
                  "to_first_step_s": marks[0] - t_start}}), flush=True)
"""


#: ``tfpar compare`` (``parity_tests.cli.main``) with every run it makes written to a file, one JSON line
#: each: the session's default runner calls ``comparison.run_impl`` through the module's global at each
#: call (the pair's runs, the mapped ones, the localisation's capture runs, reruns), so counting there
#: changes no run and no verdict
_COUNTED = r"""
import json, sys, time
from parity_tests.contract.case import load_case
from parity_tests.session import comparison
from parity_tests import cli

case_path, record, stages, *argv = sys.argv[1:]
if stages == "0":  # --no-capture: the localisation's stage chain (its capture runs) off, all else the same
    compare_case = comparison.compare_case
    comparison.compare_case = lambda *a, **k: compare_case(*a, **k, stages=False)
base = load_case(case_path).spec
run_impl = comparison.run_impl

def counted(c, impl):
    # a mapping changes these (a dtype variant also rewrites data and init: not a mapping)
    changed = [k for k in ("model", "optimizer", "parallel") if c.spec.get(k) != base.get(k)]
    doc = {"impl": impl, "dtype": c.spec["dtype"], "mapped": changed, "capture": c.capture,
           "steps": c.spec["steps"], "of_steps": base["steps"], "kind": type(c).__name__, "start": time.time()}
    t0 = time.perf_counter()
    try:
        return run_impl(c, impl)
    finally:
        doc["seconds"] = time.perf_counter() - t0
        with open(record, "a") as f:
            f.write(json.dumps(doc) + "\n")

comparison.run_impl = counted
sys.exit(cli.main(argv))
"""


def run_label(doc: dict) -> str:
    """One run of the compare in words: implementation, dtype, mapped or not, capture or not."""
    label = f"{doc['impl']} {doc['dtype']}"
    if doc["mapped"]:
        label += f" mapped ({', '.join(doc['mapped'])})"
    if doc["kind"] != "Case":
        label += f" ({doc['kind']})"
    if doc["capture"] and doc.get("own_capture", True):
        label += f" capture of step {doc['capture']} ({doc['steps']} steps run)"
    elif doc["capture"]:
        label += f", recording step {doc['capture']}'s per-device values as it goes (capture in place)"
    return label


def _own_capture(d: dict, docs: list[dict]) -> bool:
    """A capture run of its own (cut after its step, or beside the same run without a capture), not a training that
    records the step in place (``EngineSpec.captures_in_place``)."""
    same = (d["impl"], d["dtype"], d["mapped"])
    return bool(d["capture"]) and (d["steps"] < d.get("of_steps", d["steps"]) or any(
        o is not d and not o["capture"] and (o["impl"], o["dtype"], o["mapped"]) == same for o in docs))


def runs_per_compare(docs: list[dict]) -> str:
    """``runs per compare: N (T trainings, C capture runs)`` and one line per run, in the order they began."""
    for d in docs:
        d["own_capture"] = _own_capture(d, docs)
    captures = sum(1 for d in docs if d["own_capture"])
    in_place = sum(1 for d in docs if d["capture"] and not d["own_capture"])
    lines = [f"runs per compare: {len(docs)} ({len(docs) - captures} trainings, {in_place} of them capturing a step in"
             f" place; {captures} capture runs; {sum(1 for d in docs if d['mapped'])} mapped)"]
    t0 = min((d["start"] for d in docs), default=0.0)
    lines += [f"  run {i}: {run_label(d)}, {d['seconds']:.1f} s (from {d['start'] - t0:.1f} s after the first run began)"
              for i, d in enumerate(sorted(docs, key=lambda d: d["start"]), 1)]
    spans = sorted((d["start"], d["start"] + d["seconds"]) for d in docs)
    busy, end = 0.0, t0
    for a, b in spans:  # the time at least one run was in flight (runs beside each other overlap)
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    lines.append(f"  runs in flight {busy:.1f} s of the {end - t0:.1f} s from the first run's start to the last's end")
    return "\n".join(lines)


def children_cpu() -> float:
    """User + system CPU seconds of this process's finished children and the descendants they waited for
    (``RUSAGE_CHILDREN``): the compare's whole tree (its TensorFlow children, torch ranks) once it has
    exited. On a shared machine CPU time moves far less with the load than wall time does."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def plain(framework: str, model: str, dtype: str, steps: int, batch: int, seq: int) -> dict:
    """One plain training process; its JSON line plus ``wall_s`` (process start to exit)."""
    code = (_KERAS if framework == "keras" else _TORCH).format(args=(*CONFIGS[model], dtype, steps, batch, seq))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    t0, cpu0 = time.perf_counter(), children_cpu()
    out = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=7200)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    if out.returncode != 0:
        raise SystemExit(f"plain {framework} {dtype} failed:\n{out.stderr[-3000:]}")
    doc = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    return {**doc, "wall_s": wall, "cpu_s": cpu}


def make_case(folder: Path, model: str, steps: int, devices: int, batch: int, seq: int) -> Path:
    """The example case with this run's steps, devices, batch and sequence length."""
    raw = json.loads((ROOT / "examples" / "architectures" / model / "case.json").read_text())
    raw.update(steps=steps, dtype="float32")
    raw["parallel"]["devices"] = devices
    raw["data"]["global_batch"] = batch
    raw["model"]["input_shape"] = [seq]
    path = folder / "case.json"
    path.write_text(json.dumps(raw, indent=1))
    return path


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def profile(case_path: Path) -> None:
    """The compare in this process, its resident memory sampled every 0.2 s and labelled by the runs
    in flight, one after another (a runner of its own: no torch run beside a TensorFlow one); no runs: judging.
    Each run's time is printed after it."""
    import threading

    from parity_tests.contract.case import load_case
    from parity_tests.running.harness import run_impl
    from parity_tests.session.comparison import compare_case

    active: list[str] = []
    peaks: dict[str, int] = {}
    spent: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            label = " + ".join(sorted(active)) or "judging (no run in flight)"
            peaks[label] = max(peaks.get(label, 0), _rss())

    def runner(c, impl):
        mapped = any(c.spec[k] != case.spec[k] for k in ("model", "optimizer", "parallel"))
        label = f"{impl}@{c.spec['dtype']}" + (" mapped" if mapped else "") + (
            f" capture step {c.capture} of {c.spec['steps']}" if c.capture else "")
        active.append(label)
        t0 = time.perf_counter()
        try:
            return run_impl(c, impl)
        finally:
            spent.append(time.perf_counter() - t0)
            active.remove(label)
            print(f"  after {label} ({time.perf_counter() - t0:.1f} s): resident {_rss() / 1e9:.2f} GB", flush=True)

    case = load_case(case_path)
    print(f"  case loaded: resident {_rss() / 1e9:.2f} GB", flush=True)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    result = compare_case(case, ["tf.towers", "torch.ddp"], runner=runner)
    wall = time.perf_counter() - t0
    stop.set()
    thread.join()
    print(f"  verdict: {result.pairs[0].verdict.status}; compare_case {wall:.1f} s, of which runs {sum(spent):.1f} s, "
          f"the rest (judging, localising, preparing cases) {wall - sum(spent):.1f} s")
    for label, peak in sorted(peaks.items(), key=lambda kv: -kv[1]):
        print(f"  peak resident {peak / 1e9:6.2f} GB while {label}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="gpt-29m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="global batch, sequences (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the context)")
    ap.add_argument("--floor-gb", type=float, default=1.0,
                    help="stop the compare when the machine's available memory falls under this (default 1 GB)")
    ap.add_argument("--report", type=Path, default=None, help="the compare's report folder (tfpar compare --report)")
    ap.add_argument("--plain-only", action="store_true", help="only the plain Keras / torch runs")
    ap.add_argument("--no-plain", action="store_true", help="only the compare")
    ap.add_argument("--no-capture", action="store_true",
                    help="the compare without the localisation's capture runs (compare_case(stages=False)): what"
                         " they cost where the verdict does not need them (the report's localisation then stops at"
                         " the recorded channels)")
    ap.add_argument("--profile", action="store_true",
                    help="only the compare, in this process: resident memory by the runs in flight")
    args = ap.parse_args()
    seq = args.seq or CONFIGS[args.model][1]
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            profile(make_case(Path(tmp), args.model, args.steps, args.devices, args.batch, seq))
        return 0
    print(f"{args.model}: {args.steps} steps, global batch {args.batch} x {seq} tokens; "
          f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    wall = None
    if not args.plain_only:
        with tempfile.TemporaryDirectory() as tmp:
            case = make_case(Path(tmp), args.model, args.steps, args.devices, args.batch, seq)
            record = Path(tmp) / "runs.jsonl"
            record.touch()
            wall, peaks, rc, tail = watch(
                [PY, "-c", _COUNTED, str(case), str(record), "0" if args.no_capture else "1", "compare", str(case), "--impls", "tf.towers,torch.ddp",
                 *(["--report", str(args.report)] if args.report else [])],
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, floor_bytes=int(args.floor_gb * 1e9))
            runs = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
        lines = [line for line in tail.strip().splitlines() if line.strip()]
        print("\n".join(lines[-12:]) if lines else "(no output)")
        cpu = sum(LAST_CPU.values())
        print(f"compare ({args.devices} devices, float32 case): exit {rc}, {wall:.1f} s wall, {cpu:.1f} CPU seconds "
              f"(every process of its tree); load average {os.getloadavg()[0]:.2f} at the end")
        print(runs_per_compare(runs))
        print("  per process (maxima over the compare; PSS sampled every 0.2 s, resident the kernel's high-water mark):")
        for pid, (role, peak) in sorted(peaks.items(), key=lambda kv: -LAST_PSS.get(kv[0], 0)):
            if peak > 100e6:
                print(f"  PSS {LAST_PSS.get(pid, 0) / 1e9:6.2f} GB  max resident {peak / 1e9:6.2f} GB  pid {pid} {role}")
        print(f"  greatest PSS in any process: {max(LAST_PSS.values(), default=0) / 1e9:.2f} GB (max resident "
              f"{max(p for _, p in peaks.values()) / 1e9:.2f} GB); the whole tree at one sample at most "
              f"{LAST_TREE['tree_peak'] / 1e9:.2f} GB (PSS); least available on the machine "
              f"{LAST_TREE['least_available'] / 1e9:.2f} GB of {psutil.virtual_memory().total / 1e9:.2f} GB")
    if args.no_plain:
        return 0
    total = steps_total = plain_cpu = 0.0
    for framework in ("keras", "torch"):
        for dtype in ("float32", "float64"):
            r = plain(framework, args.model, dtype, args.steps, args.batch, seq)
            total += r["wall_s"]
            plain_cpu += r["cpu_s"]
            steps_total += r["steps_s"]
            print(f"  plain {framework} {dtype}: {r['params'] / 1e6:.2f} M parameters, process {r['wall_s']:.1f} s "
                  f"({r['cpu_s']:.1f} CPU seconds), "
                  f"training steps {r['steps_s']:.1f} s ({r['after_first_s']:.1f} s after the first), "
                  f"peak resident {r['peak'] / 1e9:.2f} GB, last loss {r['loss']:.3f}", flush=True)
    print(f"plain, four processes one after another: {total:.1f} s ({steps_total:.1f} s of training steps), "
          f"{plain_cpu:.1f} CPU seconds; load average {os.getloadavg()[0]:.2f}")
    if wall is not None:
        print(f"compare / plain = {wall / total:.2f}x (processes), {wall / steps_total:.2f}x (training steps), "
              f"{cpu / plain_cpu:.2f}x (CPU seconds: what moves least with the machine's load)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
