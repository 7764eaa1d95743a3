""".venv/bin/python benchmarks/bench_error_rates.py [--pairs 1000] [--bugs 300] [--seed 0] [--quick] [--out DIR] [--only NAME] [--schedule]

Measured error rates of the judge on cases nobody tuned (issue 25, item 7).

Hypothesis draws cases (dense models, 1-8 devices, uneven shards, float32,
float64 and mixed_bfloat16, SGD / momentum / Adam under every semantics with
hyperparameters that include 0, 1, tiny and huge values, clipping thresholds
always / sometimes / never reached, a warmup_cosine learning-rate schedule on one
case in five: ``--schedule`` draws only those) and pairs of implementations on them
(``parity_tests/tests/hunt/corpus.py``):

* equivalent pairs: two correct implementations, built-ins or the rewrites of
  ``parity_tests/tests/hunt/`` (``tf.add_n``, ``tf.stack`` + ``reduce_mean``, one
  concatenated-loss mean, Keras model + Keras optimizer; DDP, a hand all-reduce,
  one process);
* bug pairs: a correct implementation against one with a seeded classic bug
  (the mutants of docs/mutants.md rewritten to honour any case, wrong logged
  losses that record no ``grads=``, and porting bugs seeded into the built-ins).

Each pair is judged by ``compare_case`` (no per-device localisation) and held
against the ground truth of ``corpus.truth`` (docs/error-rates.md). Prints false
alarms / pairs and misses / bugs per dtype and per deciding rule, then one line
per false alarm and miss with its replay (the case is written under ``--out``;
``--replay FILE`` re-judges one pair and prints the judge's summary). Everything
is also written to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

QUICK = (60, 30)


def draw(kind: str, count: int, seed: int, weights: dict | None = None, only: str | None = None,
         schedule: bool = False) -> list:
    """``count`` pairs of ``kind`` drawn by hypothesis from ``seed`` (generation only: nothing to shrink);
    with ``only``, just the pairs one of whose implementations' names contains it (``programs.py``, ``ddp_l2``);
    with ``schedule``, just the cases with a ``warmup_cosine`` schedule (one in five of those drawn)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from parity_tests.tests.hunt.corpus import pairs

    out: list = []
    seen: set = set()
    for round_ in range(100):
        if len(out) >= count:
            break

        # a run's first examples are hypothesis' simplest (the same in every run): a later run asks for more
        # than are missing, or it could draw nothing new
        missing = count - len(out)
        @settings(max_examples=missing + 10 if round_ == 0 else max(2 * missing, 50), database=None, phases=[Phase.generate],
                  deadline=None, suppress_health_check=list(HealthCheck))
        @hseed(seed * 1000 + round_)
        @given(pairs(kind, weights))
        def collect(p):
            key = json.dumps([p.raw, p.reference, p.impl, p.bug.label if p.bug else None], sort_keys=True)
            if only is not None and only not in p.reference + p.impl:
                return
            if schedule and "schedule" not in p.raw["optimizer"]:
                return
            if key not in seen and len(out) < count:  # hypothesis may generate the same example twice
                seen.add(key)
                out.append(p)

        collect()
    return out[:count]


def judge_pair(pair) -> dict:
    """Judge one pair; the result as plain data."""
    from parity_tests.session.comparison import compare_case
    from parity_tests.tests.hunt.corpus import behind, judgement, mutated_runner

    t0 = time.perf_counter()
    row = {"kind": pair.kind, "raw": pair.raw, "reference": pair.reference, "impl": pair.impl, "behind": behind(pair),
           "bug": pair.bug.name if pair.bug else None, "bug_impl": pair.bug.impl if pair.bug else None,
           "dtype": pair.raw["dtype"], "summary": pair.describe()}
    try:
        result = compare_case(pair.case(), [pair.reference, pair.impl], runner=mutated_runner(pair.bug),
                              stages=False, skip_unsupported=True)
    except Exception as e:  # an implementation failed outright: no verdict
        row.update(status="error", rule="raised", gap=float("nan"), bound=float("nan"),
                   detail=f"{type(e).__name__}: {e}".splitlines()[0], right=False,  # nothing judged: a bug not caught either
                   why="an implementation raised", seconds=time.perf_counter() - t0)
        return row
    p = result.pairs[0]
    v = p.verdict
    d = pair.raw["dtype"]
    trajs = result.trajectories
    right, why = judgement(pair, v.status, trajs.get(f"{pair.reference}@{d}"), trajs.get(f"{pair.impl}@{d}"),
                           trajs.get(f"{pair.reference}@float64"), trajs.get(f"{pair.impl}@float64"))
    row.update(status=v.status, rule=v.rule, gap=float(v.gap), bound=float(v.bound), key=v.key,
               first_step=v.first_step, detail=v.detail.splitlines()[0] if v.detail else "", right=right, why=why,
               expected=list(p.prediction.expected), seconds=time.perf_counter() - t0)
    return row


def _frac(bad: int, total: int) -> str:
    return f"{bad} / {total}" if total else "-"


def table(rows: list[dict]) -> str:
    """False alarms / equivalent pairs and misses / bugs, per dtype and per deciding rule."""
    eq = [r for r in rows if r["kind"] == "equivalent" and r["status"] != "unsupported"]
    bugs = [r for r in rows if r["kind"] == "bug" and r["status"] != "unsupported"]
    lines = ["| | false alarms / pairs | misses / bugs |", "| --- | --- | --- |"]

    def add(label: str, pick) -> None:
        e, b = [r for r in eq if pick(r)], [r for r in bugs if pick(r)]
        lines.append(f"| {label} | {_frac(sum(not r['right'] for r in e), len(e))} |"
                     f" {_frac(sum(not r['right'] for r in b), len(b))} |")

    add("**all**", lambda r: True)
    add("lr 0 (right: inconclusive)", lambda r: r["raw"]["optimizer"]["lr"] == 0)
    add("lr > 0", lambda r: r["raw"]["optimizer"]["lr"] > 0)
    for d in ("float32", "float64", "mixed_bfloat16"):
        add(f"dtype {d}", lambda r, d=d: r["dtype"] == d)
    add("a program as users write it (hunt/programs.py, ddp_l2)",
        lambda r: "programs.py" in r["reference"] + r["impl"] or "ddp_l2" in r["reference"] + r["impl"])
    add("float32 at 4+ devices", lambda r: r["dtype"] == "float32" and r["raw"]["parallel"]["devices"] >= 4)
    add("warmup_cosine schedule", lambda r: "schedule" in r["raw"]["optimizer"])
    for sem in ("native", "tf", "torch"):
        add(f"warmup_cosine, semantics {sem}",
            lambda r, sem=sem: "schedule" in r["raw"]["optimizer"] and r["raw"]["optimizer"]["semantics"] == sem)
    for rule in sorted({r["rule"] for r in eq + bugs}):
        add(f"rule: {rule}", lambda r, rule=rule: r["rule"] == rule)
    b = [r for r in bugs if r["why"].startswith("nothing moves on either side")]
    lines.append(f"| bugs on cases where nothing moves, inconclusive by the verdict rules (counted right) | - | {len(b)} |")
    b = [r for r in bugs if r["why"].startswith("both runs overflow, the correct one too")]
    lines.append(f"| bugs on cases whose correct run overflows too, error or inconclusive (counted right) | - | {len(b)} |")
    b = [r for r in bugs if not r["behind"]]
    lines.append(f"| bugs, the reference computes what the bug's correct version does | - |"
                 f" {_frac(sum(not r['right'] for r in b), len(b))} |")
    b = [r for r in bugs if r["behind"]]
    lines.append(f"| bugs, the reference differs from it by construction (a predicted difference) | - |"
                 f" {_frac(sum(not r['right'] for r in b), len(b))} |")
    return "\n".join(lines)


def breakdown(rows: list[dict]) -> str:
    """Wrong verdicts by status (false alarms) and by bug (misses)."""
    eq = [r for r in rows if r["kind"] == "equivalent" and not r["right"]]
    bugs = [r for r in rows if r["kind"] == "bug" and r["status"] != "unsupported"]
    out = ["false alarms by verdict: " + (", ".join(f"{s} {k}" for s, k in Counter(r["status"] for r in eq).most_common())
                                       or "none")]
    per = defaultdict(lambda: [0, 0])
    for r in bugs:
        impl = r["bug_impl"]
        label = impl.removeprefix("mutant:") if impl.startswith("mutant:") else (
            ("tf:" if "tf_side" in impl else "prog:" if "programs.py" in impl else "torch:") + r["bug"])
        per[label][1] += 1
        per[label][0] += not r["right"]
    out.append("misses by bug: " + ", ".join(f"{k} {m}/{t}" for k, (m, t) in sorted(per.items())))
    return "\n".join(out)


def replay_line(row: dict, folder: Path, index: int) -> str:
    """Write the pair's case (and the pair) under ``folder``; the commands that replay it."""
    from parity_tests.contract.case import case_from_dict
    from parity_tests.testing.failures import record_failure

    case = case_from_dict(json.loads(json.dumps(row["raw"])))
    path = record_failure(case, folder / f"pair-{index:04d}")
    pair_file = path.parent / "pair.json"
    pair_file.write_text(json.dumps({k: row[k] for k in ("raw", "reference", "impl", "bug", "bug_impl")}, indent=1))
    cmd = f"python benchmarks/bench_error_rates.py --replay {pair_file}"
    if row["bug"] is None or not row["bug_impl"].startswith("mutant:"):  # no mutant: the tool's own command replays it
        cmd += f"   |   tfpar compare {path} --impls {_short(row['reference'])},{_short(row['impl'])}"
    return cmd


def _short(name: str) -> str:
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return name.replace(root, "")


def listing(rows: list[dict], folder: Path) -> str:
    out = []
    for i, r in enumerate(rows):
        if r["right"] or r["status"] == "unsupported":
            continue
        what = "MISS" if r["kind"] == "bug" else "FALSE ALARM"
        bug = f" [bug {r['bug']}]" if r["bug"] else ""
        out.append(f"- {what}{bug}: {_short(r['reference'])} vs {_short(r['impl'])}: {r['status']} ({r['rule']},"
                   f" gap {r['gap']:.3g}, bound {r['bound']:.3g}); {r['summary']}; {r['why']}\n"
                   f"  replay: {replay_line(r, folder, i)}")
    return "\n".join(out) if out else "(none)"


def replay(path: Path) -> None:
    """Re-judge the pair in ``path`` (a ``pair.json`` the hunt wrote) and print the judge's summary."""
    from parity_tests.session.comparison import compare_case
    from parity_tests.tests.hunt.corpus import BUGS, Pair, judgement, mutated_runner

    d = json.loads(path.read_text())
    bug = None
    if d["bug"]:  # a mutated built-in was once named after the built-in itself: match its base too
        bug = next(b for b in BUGS if b.name == d["bug"] and d["bug_impl"] in (b.impl, b.base))
    pair = Pair(d["raw"], d["reference"], bug.impl if bug else d["impl"], bug)
    result = compare_case(pair.case(), [pair.reference, pair.impl], runner=mutated_runner(bug))
    print(result.summary())
    trajs, dt = result.trajectories, pair.raw["dtype"]
    ok, why = judgement(pair, result.pairs[0].verdict.status,
                        trajs.get(f"{pair.reference}@{dt}"), trajs.get(f"{pair.impl}@{dt}"),
                        trajs.get(f"{pair.reference}@float64"), trajs.get(f"{pair.impl}@float64"))
    print(f"ground truth: {why} -> {'right' if ok else 'WRONG'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=1000, help="equivalent pairs (default 1000)")
    ap.add_argument("--bugs", type=int, default=300, help="seeded-bug pairs (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK[0]} pairs and {QUICK[1]} bugs")
    ap.add_argument("--out", type=Path, default=Path("failures/error-rates"), help="where cases and results.json go")
    ap.add_argument("--replay", type=Path, help="re-judge one pair.json written by an earlier hunt")
    ap.add_argument("--only", help="draw only pairs with an implementation whose name contains this (e.g. programs.py)")
    ap.add_argument("--schedule", action="store_true", help="draw only cases with a warmup_cosine schedule")
    args = ap.parse_args()

    from parity_tests.running.backends import reserve_tf_devices

    reserve_tf_devices(8)
    from torchref.pool import shutdown_pool

    try:
        if args.replay:
            replay(args.replay)
            return
        n_pairs, n_bugs = QUICK if args.quick else (args.pairs, args.bugs)
        t0 = time.perf_counter()
        from parity_tests.tests.hunt.corpus import bug_weights

        equivalent = draw("equivalent", n_pairs, args.seed, only=args.only, schedule=args.schedule)
        todo = equivalent + draw("bug", n_bugs, args.seed, bug_weights([p.raw for p in equivalent]), only=args.only,
                                 schedule=args.schedule)
        drawn = time.perf_counter() - t0
        from tqdm import tqdm

        rows = []
        for pair in tqdm(todo, desc="pairs", unit="pair", dynamic_ncols=True):
            rows.append(judge_pair(pair))
        total = time.perf_counter() - t0
    finally:
        shutdown_pool()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    unsupported = sum(r["status"] == "unsupported" for r in rows)
    judged = [r["seconds"] for r in rows if r["status"] != "unsupported"]
    print(f"\nerror rates of the judge: {n_pairs} equivalent pairs, {n_bugs} seeded bugs, seed {args.seed}"
          f" ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores)\n")
    print(table(rows))
    print()
    print(breakdown(rows))
    print(f"\n{len(rows)} pairs in {total:.0f} s (drawing {drawn:.1f} s; per judged pair median"
          f" {sorted(judged)[len(judged) // 2]:.2f} s, max {max(judged):.1f} s); {unsupported} refused as unsupported"
          " (not counted)\n")
    print("false alarms and misses:")
    print(listing(rows, args.out))


if __name__ == "__main__":
    main()
