"""Every built-in engine's trajectory on every case of the scenario matrix, hashed: proof that a change kept them bit for bit.

    .venv/bin/python benchmarks/trajectory_hashes.py --out before.json        # before a change
    .venv/bin/python benchmarks/trajectory_hashes.py --check before.json      # after it: exit 1 on any array that moved

Each case of ``reporting.matrix.matrix_cases`` runs on each built-in (``tf.towers``, ``tf.single``,
``tf.v1``, ``tf.mirrored``, ``torch.ddp``, ``torch.single``) in its own dtype and, for a float32 case,
in float64 too; a case an engine refuses is recorded as refused. The SHA-256 of every array (its
dtype, shape and bytes) goes to the JSON file. Bit-identity holds on one machine: another CPU may
take other kernels (docs/mixed-precision.md), so compare runs made on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

IMPLS = ("tf.towers", "tf.single", "tf.v1", "tf.mirrored", "torch.ddp", "torch.single")


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    return hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()


def hashes(quick: bool, impls: tuple[str, ...] = IMPLS, capture: int | None = None) -> dict[str, dict[str, str] | str]:
    """``capture``: every run of an engine that captures made with ``capture = k``, its per-device ``device/...``
    arrays left out: whether such a run trains as the plain run does, bit for bit (the session takes a
    pair's float64 run and its capture of step 1 from one run where the engine declares so,
    ``EngineSpec.captures_in_place``)."""
    import dataclasses

    from tqdm import tqdm

    from parity_tests.protocol.errors import CaseError
    from parity_tests.reporting.matrix import matrix_cases
    from parity_tests.running import registry
    from parity_tests.running.harness import run_impl

    # --quick: 1 and 2 devices, no 16-64 device rows (the large worlds need a 64-rank pool)
    cases = matrix_cases(devices=(1, 2), large_world=()) if quick else matrix_cases()
    out: dict[str, dict[str, str] | str] = {}
    jobs = [(c, i, d) for c in cases for i in impls for d in dict.fromkeys([c.spec["dtype"], "float64"])
            if not (d == "float64" and c.spec["dtype"] == "mixed_bfloat16")]
    for case, impl, dtype in tqdm(jobs, unit="run", file=sys.stderr):
        key = f"{case.name}|{impl}|{dtype}"
        try:
            run = case if case.spec["dtype"] == dtype else case.replace(dtype=dtype)
            if capture is not None and registry.resolve(impl, "impls").captures and capture <= run.spec["steps"]:
                run = dataclasses.replace(run, capture=capture)
            traj = run_impl(run, impl)
        except CaseError as e:
            out[key] = f"refused: {e.field}"
            continue
        out[key] = {k: _digest(v) for k, v in sorted(traj.items()) if not k.startswith("device/")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the hashes here")
    ap.add_argument("--check", type=Path, help="compare against hashes written before; exit 1 on a difference")
    ap.add_argument("--quick", action="store_true", help="1 and 2 devices only, no large-world rows")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated built-ins to hash (default all); --check then compares their runs only")
    ap.add_argument("--capture", type=int, metavar="K",
                    help="make every run of an engine that captures with capture = K, its device/ arrays left out"
                         " (--check then says whether a run with a capture trains as the plain run does)")
    args = ap.parse_args(argv)
    impls = tuple(args.impls.split(","))
    t0 = time.perf_counter()
    now = hashes(args.quick, impls, args.capture)
    print(f"{len(now)} runs hashed in {time.perf_counter() - t0:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    if args.check:
        before = json.loads(args.check.read_text())
        if args.capture is not None:  # a capture run's device/ arrays are its own
            before = {k: {a: h for a, h in v.items() if not a.startswith("device/")} if isinstance(v, dict) else v
                      for k, v in before.items()}
        keys = set(now) | {k for k in before if k.split("|")[1] in impls}
        moved = [k for k in sorted(keys) if before.get(k) != now.get(k)]
        for k in moved[:50]:
            b, n = before.get(k), now.get(k)
            arrays = sorted(a for a in set(b or {}) | set(n or {}) if (b or {}).get(a) != (n or {}).get(a)) \
                if isinstance(b, dict) and isinstance(n, dict) else [f"{b!r} -> {n!r}"[:120]]
            print(f"moved: {k}: {', '.join(arrays[:6])}")
        print(f"{len(moved)} of {len(now)} runs differ from {args.check}")
        return 1 if moved else 0
    return 0


if __name__ == "__main__":
    from torchref.pool import shutdown_pool

    try:
        sys.exit(main())
    finally:
        shutdown_pool()
