"""How far ``param_mean`` and ``async`` drift from ``grad_mean`` on the classic tower programs' MLP (docs/combine-rules.md).

    .venv/bin/python benchmarks/combine_drift.py

``examples/seed003-mlp`` (5-10-1, 4 devices, global batch 400, 25 steps) in
float64 with torch's exact rules, lr 0.001, for SGD and Adam. Prints, per rule,
the judge's float64 gap (greatest relative parameter gap over the run) of
``tf.towers`` against ``grad_mean``, against ``grad_mean`` with the learning
rate times N, and against ``torch.ddp`` running the same rule.
"""

from __future__ import annotations

from parity_tests.contract.case import load_case
from parity_tests.judging.rules import judge_float64
from parity_tests.running.harness import run_impl

RULES = [("param_mean", {"parallel.period": 1}), ("param_mean", {"parallel.period": 4}),
         ("async", {"parallel.staleness": 0}), ("async", {"parallel.staleness": 3})]


def main() -> None:
    base = load_case("examples/seed003-mlp/case.json").replace(dtype="float64")
    print("optimizer  rule        setting           vs grad_mean  vs grad_mean lr x N  tf.towers vs torch.ddp")
    for opt in ({"name": "sgd", "lr": 0.001, "semantics": "torch"}, {"name": "adam", "lr": 0.001, "semantics": "torch"}):
        sync = base.replace(optimizer=opt)
        ref = run_impl(sync, "tf.towers")
        ref_n = run_impl(sync.replace(**{"optimizer.lr": opt["lr"] * sync.devices}), "tf.towers")
        for combine, extra in RULES:
            case = sync.replace(**{"parallel.combine": combine, **extra})
            tf, torch = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
            (field, value), = extra.items()
            setting = f"{field.split('.')[1]} {value}"
            print(f"{opt['name']:10} {combine:11} {setting:17} {judge_float64(tf, ref).gap:12.1e}"
                  f" {judge_float64(tf, ref_n).gap:20.1e} {judge_float64(tf, torch).gap:23.1e}")


if __name__ == "__main__":
    main()
