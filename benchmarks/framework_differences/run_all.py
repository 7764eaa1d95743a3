"""Run every framework-difference measurement (issue 27's table) and print the table.

    .venv/bin/python benchmarks/framework_differences/run_all.py [--only gelu,loss_scale] [--verbose]

Each script runs on its own (TensorFlow and torch in separate spawned processes) and ends with
``RESULT {json}`` lines; this driver runs them one after another (the machine's cores are shared),
collects those lines and prints a Markdown table: row, whether the issue's claim held, the measured
gap, the condition under which the difference vanishes, and the mapping. ``--verbose`` also prints
each script's own figures. About 8 minutes on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "layer_norm_epsilon", "gelu", "attention_mask", "attention_layout", "embedding_sparse_moments",
    "same_padding", "sync_batch_norm", "weight_decay", "bf16_residual", "loss_scale",
    "attention_key_bias", "tiny_vit_drift", "token_cross_entropy", "warmup_cosine",
]


def run(name: str, verbose: bool) -> tuple[list[dict], float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / f"{name}.py")], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if verbose:
        print(f"## {name} ({seconds:.0f} s)")
        print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")))
    if proc.returncode != 0 or not rows:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        rows = [{"row": name, "held": "error", "gap": tail[:200], "condition": "", "mapping": ""}]
    return rows, seconds, name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated script names")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or SCRIPTS
    table, total = [], 0.0
    for name in names:
        rows, seconds, _ = run(name, args.verbose)
        total += seconds
        table += [{**r, "script": name} for r in rows]
    print("| row | claim held | measured gap | vanishes when | mapping | script |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in table:
        held = {True: "yes", False: "no"}.get(r["held"], r["held"])
        cells = [r["row"], held, r["gap"], r["condition"], r["mapping"], f"{r['script']}.py"]
        print("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")  # |z| in a cell
    print(f"\n{len(names)} scripts, {total:.0f} s")


if __name__ == "__main__":
    main()
