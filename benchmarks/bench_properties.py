"""The property suite's cost per example (issue 11's target: 0.5 s).

    .venv/bin/python benchmarks/bench_properties.py [--profiles dev,ci]

Runs ``pytest parity_tests/tests/test_properties.py`` once per hypothesis profile (``dev``:
5 examples a property, ``ci``: 12, what ``make test`` runs), each in a fresh process on one
pytest worker, and reads pytest's JUnit report and hypothesis' statistics. Prints per
profile: the examples run, the wall time, the test calls' time, the rest (starting Python,
collection, the session pool's start in its fixture), and

* the cost per example: the calls' time over the examples (each property's first example
  also pays one-time costs: importing TensorFlow, its first traces);
* the marginal cost per example, between two profiles: the difference of the calls' times
  over the difference of the examples, which leaves every one-time cost out;
* the suite's whole time per example (wall time over examples, start-up included).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = "parity_tests/tests/test_properties.py"


def run(profile: str) -> dict[str, float]:
    """One run of the property suite under ``profile``: wall and test-call seconds, examples run."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = {**os.environ, "HYPOTHESIS_PROFILE": profile}
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", SUITE, "-p", "no:randomly", "-p", "no:cacheprovider",
             "--hypothesis-show-statistics", f"--junitxml={report}", "-o", "junit_duration_report=call"],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            sys.exit(f"bench_properties: the suite failed under profile {profile}:\n{out.stdout[-3000:]}")
        calls = sum(float(tc.get("time", 0)) for tc in ET.parse(report).getroot().iter("testcase"))
    examples = sum(int(n) for n in re.findall(r"(\d+) passing(?: examples)?,", out.stdout))
    return {"wall": wall, "calls": calls, "examples": examples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="dev,ci", help="two or more hypothesis profiles (default: dev,ci)")
    args = parser.parse_args(argv)
    results = {}
    print(f"{'profile':<9} {'examples':>8} {'wall s':>8} {'calls s':>8} {'rest s':>7} {'s/example':>10} {'wall/example':>13}")
    for profile in args.profiles.split(","):
        r = results[profile] = run(profile)
        print(f"{profile:<9} {r['examples']:>8d} {r['wall']:>8.1f} {r['calls']:>8.1f} {r['wall'] - r['calls']:>7.1f} "
              f"{r['calls'] / r['examples']:>10.3f} {r['wall'] / r['examples']:>13.3f}", flush=True)
    names = list(results)
    for a, b in zip(names, names[1:], strict=False):
        ra, rb = results[a], results[b]
        extra = rb["examples"] - ra["examples"]
        if extra > 0:
            print(f"marginal cost per example, {a} -> {b}: {(rb['calls'] - ra['calls']) / extra:.3f} s "
                  f"({extra} more examples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
