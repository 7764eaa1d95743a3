"""``tfpar matrix``: the built-in scenario matrix, written as a report.

Rows: the classic tower programs' scenarios (polynomial regression with Adam, the 5-10-1 binary
MLP with SGD, a softmax classifier with momentum) x device counts 1, 2, 4, 8 x
both combine rules x float32 and float64; in every row ``tf.towers`` is the
reference and ``torch.ddp``, ``tf.single``, ``torch.single``, ``tf.v1`` (the
classic tower programs' graph towers) and ``tf.mirrored`` are judged against it (a path that
does not implement a row's features is listed as ``unsupported``). Then the rows where theory predicts a difference: sum reduction
under data parallelism, uneven shards with equal weighting (and the
``by_size`` weighting that removes it), and native Adam across frameworks
(epsilon placement), batch norm with each framework's moving variance,
``param_mean`` and ``async``, and gradient clipping before and after the
combine. Mixed precision (``mixed_bfloat16``: Keras' policy against torch's CPU
autocast, each side held against its float64 run): the seed MLP and the CNN
at 1, 2 and 4 devices (docs/mixed-precision.md). The real architectures of
``examples/architectures/`` at their smallest sizes (:data:`ARCHITECTURES`: ResNet with option-A
and with projection shortcuts, ViT, GPT), each at 1, 2, 4 and 8 devices, with float32/float64,
grad_mean/loss_mean and native/mapped semantics (:func:`mapped`) drawn from a 2-level orthogonal
array (:data:`ARCHITECTURE_ROWS`). The exit status is 0 only when every verdict is the expected one.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity_tests.contract.case import Case, case_from_dict, with_changes
from parity_tests.contract.model import rewrite_layers
from parity_tests.protocol.atomic import atomic_write_text
from parity_tests.reporting.architectures import case as arch_case
from parity_tests.reporting.architectures import gpt, resnet_cifar_a, resnet_cifar_b, vit
from parity_tests.reporting.report import jsonable, write_report
from parity_tests.running.builtins import SPECS
from parity_tests.running.environment import versions
from parity_tests.session.comparison import CaseResult, compare_case

__all__ = ["Scenario", "SCENARIOS", "ARCHITECTURES", "ARCHITECTURE_ROWS", "mapped", "EXPECTED_ROWS", "MIXED_SCENARIOS", "MIXED_DEVICES", "LARGE_WORLD", "matrix_cases", "run_matrix"]

#: every in-process built-in, as the engines declare them (``tfpar.engines``, ``torchref.engines``): the
#: reference pair first (each framework's first parallel engine: tf.towers, torch.ddp), the rest in
#: declaration order
_PAIR = [next(s.name for s in SPECS if s.in_process and s.parallel and s.framework == f) for f in ("tf", "torch")]
IMPLS = [*_PAIR, *(s.name for s in SPECS if s.in_process and s.name not in _PAIR)]


@dataclass(frozen=True)
class Scenario:
    name: str
    case: dict[str, Any]


def _base(name: str, model: dict, data: dict, optimizer: dict, init: dict, steps: int = 10) -> dict:
    return {"schema": "parity-case/1", "name": name, "dtype": "float64", "model": model, "init": init,
            "data": data, "optimizer": optimizer, "parallel": {"devices": 1}, "steps": steps}


SCENARIOS = [
    # y = 5x^2 + 3 fitted by w . [x^2, x, 1] with Adam (Keras' rule, computed exactly on both sides)
    Scenario("poly-adam", _base(
        "poly-adam",
        {"input_shape": [], "layers": [{"type": "poly", "degree": 2}, {"type": "dense", "units": 1, "use_bias": False}], "loss": "mse"},
        {"generator": "poly", "seed": 1, "global_batch": 64},
        {"name": "adam", "lr": 0.1, "semantics": "tf"},
        {"seed": 2, "kind": "normal", "stddev": 1.0})),
    # the 5-10-1 binary MLP with plain SGD, each framework's own optimizer class
    Scenario("mlp-sgd", _base(
        "mlp-sgd",
        {"input_shape": [5], "layers": [{"type": "dense", "units": 10, "activation": "relu"}, {"type": "dense", "units": 1}], "loss": "sigmoid_ce"},
        {"generator": "binary5", "seed": 3, "global_batch": 64},
        {"name": "sgd", "lr": 0.01, "semantics": "native"},
        {"seed": 4, "kind": "normal", "stddev": 0.5})),
    # a small softmax classifier with momentum, each framework's own optimizer class
    Scenario("softmax-momentum", _base(
        "softmax-momentum",
        {"input_shape": [4], "layers": [{"type": "dense", "units": 16, "activation": "tanh"}, {"type": "dense", "units": 3}], "loss": "softmax_ce"},
        {"generator": "blobs", "seed": 5, "global_batch": 64},
        {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": "native"},
        {"seed": 6, "kind": "glorot_uniform"})),
]
# the CNN of issue 4 on MNIST-shaped real digits (the UCI digits scikit-learn ships, in a 28x28x1 canvas): conv -> batch norm -> pool ->
# dropout (masks drawn in numpy from the case seed) -> dense -> softmax; batch norm computes Keras'
# moving variance on both sides (semantics "tf"), so the rows isolate local vs sync statistics
CNN = Scenario("cnn", {
    "schema": "parity-case/1", "name": "cnn", "dtype": "float64", "seed": 7,
    "model": {"input_shape": [28, 28, 1], "layers": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "strides": 2, "padding": "same", "activation": "relu"},
        {"type": "batch_norm", "momentum": 0.9, "semantics": "tf"},
        {"type": "max_pool2d", "pool_size": 2},
        {"type": "dropout", "rate": 0.25},
        {"type": "flatten"},
        {"type": "dense", "units": 10},
    ], "loss": "softmax_ce"},
    "init": {"seed": 8, "kind": "glorot_uniform"},
    "data": {"generator": "digits", "seed": 9, "global_batch": 32},
    "optimizer": {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": "torch"},
    "parallel": {"devices": 1, "batch_norm": "sync"},
    "steps": 3,
})
_BY_NAME = {s.name: s for s in SCENARIOS}
_BY_NAME[CNN.name] = CNN


# the real architectures of examples/architectures/ (parity_tests.reporting.architectures) at the
# smallest sizes that keep every kind of block: a two-stage ResNet-6 with option-A shortcuts (an identity block and a
# downsampling one), a stem plus one projection-shortcut block (ResNet-18's downsampling block) on 8x8
# images, a one-block ViT (patch 4: 4 tokens + the class token) and a
# one-block GPT (vocabulary 16, 8 tokens); local batch norm, Adam or momentum, 2 steps
ARCHITECTURES = [
    Scenario("resnet-a", arch_case("resnet-a", [8, 8, 3], resnet_cifar_a(1, (4, 8), classes=4),
                                   {"generator": "images", "seed": 11, "global_batch": 16},
                                   {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": "native"},
                                   dtype="float64", devices=1, steps=2, seed=12)),
    Scenario("resnet-b", arch_case("resnet-b", [8, 8, 3], resnet_cifar_b((0, 1), (4, 8), classes=4),
                                   {"generator": "images", "seed": 13, "global_batch": 16},
                                   {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": "native"},
                                   dtype="float64", devices=1, steps=2, seed=14)),
    Scenario("vit", arch_case("vit", [8, 8, 3], vit(image=8, patch=4, width=8, depth=1, heads=2, mlp=16, classes=4),
                              {"generator": "images", "seed": 15, "global_batch": 16},
                              {"name": "adam", "lr": 0.01, "semantics": "native"},
                              dtype="float64", devices=1, steps=2, seed=16)),
    Scenario("gpt", arch_case("gpt", [8], gpt(vocab=16, context=8, width=8, depth=1, heads=2),
                              {"generator": "tokens", "seed": 17, "global_batch": 16},
                              {"name": "adam", "lr": 0.01, "semantics": "native"},
                              dtype="float64", devices=1, steps=2, seed=18)),
]
_BY_NAME.update({s.name: s for s in ARCHITECTURES})


def mapped(raw: dict, semantics: str = "torch") -> dict:
    """``raw`` with every framework difference mapped to one framework's convention: each layer and
    the optimizer get ``semantics`` (batch norm's moving variance, GELU constants, the attention
    scale, the optimizer's update rule) and an embedding the dense gradient (``gradient: dense``)."""
    def change(layer: dict) -> dict:
        if layer["type"] in ("batch_norm", "attention") or (
                layer["type"] in ("dense", "activation") and str(layer.get("activation", layer.get("fn"))).startswith("gelu")):
            layer["semantics"] = semantics
        if layer["type"] == "embedding":
            layer["gradient"] = "dense"
        return layer

    return with_changes(raw, **{"model.layers": rewrite_layers(raw["model"]["layers"], change),
                                "optimizer.semantics": semantics})


#: (devices, dtype, combine, semantics) of each architecture's rows: every device count, and at each
#: the two dtypes, combines and semantics in a 2-level orthogonal array (every pair of values of two
#: of these fields meets), rotated between architectures so that each meets each device count in
#: another combination
_ARRAY = [("float64", "grad_mean", "native"), ("float64", "loss_mean", "mapped"),
          ("float32", "grad_mean", "mapped"), ("float32", "loss_mean", "native")]
ARCHITECTURE_ROWS: list[tuple[str, int, str, str, str]] = [
    (s.name, n, *_ARRAY[(k + a) % 4]) for a, s in enumerate(ARCHITECTURES) for k, n in enumerate((1, 2, 4, 8))]


def _with(raw: dict, name: str, **changes: Any) -> dict:
    return with_changes(raw, name=name, **changes)


# (scenario, changes): rows where theory predicts differences for some pairs
EXPECTED_ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("mlp-sum-reduction", "mlp-sgd", {"model.reduction": "sum", "optimizer.semantics": "torch"}),
    ("mlp-uneven-equal", "mlp-sgd", {"data.global_batch": 63, "optimizer.semantics": "torch"}),
    ("mlp-uneven-by_size", "mlp-sgd", {"data.global_batch": 63, "parallel.weighting": "by_size", "optimizer.semantics": "torch"}),
    ("poly-adam-native", "poly-adam", {"optimizer.semantics": "native", "optimizer.epsilon": 1e-3}),
    # each framework's own batch norm: torch's running_var takes the unbiased batch variance
    ("cnn-bn-native", "cnn", {"model.layers": [dict(layer, semantics="native") if layer["type"] == "batch_norm" else layer
                                                for layer in CNN.case["model"]["layers"]]}),
    # every device applies its own updates (docs/combine-rules.md): tf.towers vs torch.ddp must agree,
    # and both must differ from one device on the full batch
    ("poly-adam-param_mean", "poly-adam", {"parallel.combine": "param_mean", "parallel.period": 2}),
    ("mlp-async", "mlp-sgd", {"parallel.combine": "async", "parallel.staleness": 1, "optimizer.semantics": "torch"}),
    # gradient clipping by global norm, below every step's norm so that it acts: clipped inside each
    # device before averaging (the classic tower order: every parallel path agrees, one device on the
    # full batch does not), and after the combine (torch's order: every path agrees)
    ("softmax-clip-per_device", "softmax-momentum",
     {"parallel.clip": {"global_norm": 0.05, "where": "per_device"}, "optimizer.semantics": "torch"}),
    ("softmax-clip-after_combine", "softmax-momentum",
     {"parallel.clip": {"global_norm": 0.05, "where": "after_combine"}, "optimizer.semantics": "torch"}),
    # per-device clipping under synchronized batch norm: tf.towers clips each tower's own-loss
    # gradient, torch.ddp and tf.mirrored their share of the whole batch's (docs/layers.md)
    ("cnn-sync-clip-per_device", "cnn", {"parallel.clip": {"global_norm": 0.05, "where": "per_device"}}),
]


#: the scenarios run in mixed_bfloat16 (the seed MLP, the CNN with synchronized batch norm), at these device counts
MIXED_SCENARIOS = (("mlp-sgd", "mlp-sgd"), ("cnn-bn-sync", "cnn"))
MIXED_DEVICES = (1, 2, 4)


# device counts past 8 (issue 12): the 5-10-1 MLP, 3 steps, float64, where uneven shards and
# DistributedSampler's padding bite at every size. "uneven": a global batch of 2N+5 rows splits
# into N shards of 2 and 3 rows, averaged with equal weights (the device mean weights rows of smaller
# shards more; docs/large-world.md); "padded": DistributedSampler's order over 3N+5 rows, 2N a step, so
# step 2 ends the epoch and repeats the epoch's first N-5 rows to give every rank 4. Both:
# tf.towers, torch.ddp and tf.mirrored agree, one device on the full batch differs.
LARGE_WORLD: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
    ("large-world-uneven", lambda n: {"data.global_batch": 2 * n + 5, "steps": 3, "optimizer.semantics": "torch"}),
    ("large-world-padded", lambda n: {"data.order": "distributed_sampler", "data.rows": 3 * n + 5,
                                      "data.global_batch": 2 * n, "steps": 2, "optimizer.semantics": "torch"}),
]


def matrix_cases(*, devices: Iterable[int] = (1, 2, 4, 8),
                 dtypes: Iterable[str] = ("float64", "float32", "mixed_bfloat16"),
                 combines: Iterable[str] = ("grad_mean", "loss_mean"), expected_rows: bool = True,
                 large_world: Iterable[int] = (16, 32, 64), architectures: bool = True) -> list[Case]:
    """Every case of the matrix, validated, named ``scenario:nN:combine:dtype``.

    ``mixed_bfloat16`` in ``dtypes`` adds the mixed-precision rows: :data:`MIXED_SCENARIOS`
    at the device counts of ``devices`` among :data:`MIXED_DEVICES`, ``grad_mean``.
    ``large_world``: the device counts of the :data:`LARGE_WORLD` rows (added with ``expected_rows``).
    ``architectures``: the :data:`ARCHITECTURE_ROWS` whose device count, dtype and combine are asked for.
    """
    devices, dtypes, combines = list(devices), list(dtypes), list(combines)
    mixed = "mixed_bfloat16" in dtypes
    dtypes = [d for d in dtypes if d != "mixed_bfloat16"]
    cases = []
    for s in SCENARIOS:
        for n in devices:
            for combine in combines:
                for dtype in dtypes:
                    raw = _with(s.case, f"{s.name}:n{n}:{combine}:{dtype}", **{
                        "parallel.devices": n, "parallel.combine": combine, "dtype": dtype})
                    cases.append(case_from_dict(raw))
    for n in devices:
        for bn in ("sync", "local"):
            for dtype in dtypes:
                raw = _with(CNN.case, f"cnn-bn-{bn}:n{n}:grad_mean:{dtype}",
                            **{"parallel.devices": n, "parallel.batch_norm": bn, "dtype": dtype})
                cases.append(case_from_dict(raw))
    if expected_rows:
        for name, base, changes in EXPECTED_ROWS:
            for n in [d for d in devices if d > 1] or [2]:
                raw = _with(_BY_NAME[base].case, f"{name}:n{n}:{changes.get('parallel.combine', 'grad_mean')}:float64",
                            **{"parallel.devices": n, **changes})
                cases.append(case_from_dict(raw))
    if mixed:
        for name, base in MIXED_SCENARIOS:
            for n in [d for d in devices if d in MIXED_DEVICES]:
                raw = _with(_BY_NAME[base].case, f"{name}:n{n}:grad_mean:mixed_bfloat16",
                            **{"parallel.devices": n, "dtype": "mixed_bfloat16"})
                cases.append(case_from_dict(raw))
    if architectures:
        for name, n, dtype, combine, semantics in ARCHITECTURE_ROWS:
            if n in devices and dtype in dtypes and combine in combines:
                raw = _BY_NAME[name].case
                raw = mapped(raw) if semantics == "mapped" else raw
                raw = _with(raw, f"{name}-{semantics}:n{n}:{combine}:{dtype}",
                            **{"parallel.devices": n, "parallel.combine": combine, "dtype": dtype})
                cases.append(case_from_dict(raw))
    if expected_rows:
        for name, changes_for in LARGE_WORLD:
            for n in large_world:
                raw = _with(_BY_NAME["mlp-sgd"].case, f"{name}:n{n}:grad_mean:float64",
                            **{"parallel.devices": n, **changes_for(n)})
                cases.append(case_from_dict(raw))
    return cases


def _row_file(out: Path, case: Case, impls: list[str] = IMPLS) -> Path:
    key = case.spec if impls == IMPLS else {"case": case.spec, "impls": impls}  # built-in rows keep their names
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return out / "rows" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", case.name) + f"-{digest}.json")


def _load_row(path: Path, tool: dict[str, str]) -> CaseResult | None:
    """A finished row of an earlier run, if it exists and was made by the same versions."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("versions") != tool:
            return None
        return CaseResult.from_dict(doc["result"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or unreadable: run it again


def run_matrix(
    out: Path,
    *,
    quick: bool = False,
    resume: bool = False,
    cases: list[Case] | None = None,
    runner: Callable[[Case, str], Any] | None = None,
    stream=None,
    extra: list[str] | None = None,
    progress: bool = True,
    junit: Path | None = None,
) -> int:
    """Run the matrix, write the report to ``out``; returns the exit status (0: all as expected).

    ``extra``: more implementation names (plugins, installed names; resolved by the registry)
    judged against ``tf.towers`` in every row beside the built-ins; a row an implementation
    cannot run (a dtype it does not declare, a field it refuses) is reported as unsupported.
    ``progress``: the bar on ``stream`` (``tfpar --quiet``: none). ``junit``: also a JUnit XML file, one
    test case per pair of every row (``reporting.junit``). The summary line and each row not
    as expected are printed on stdout: they are ``tfpar matrix``'s output.
    """
    from tqdm import tqdm

    from parity_tests.running.registry import resolve

    for name in extra or []:
        resolve(name, "--impls")
    impls = IMPLS + [n for n in extra or [] if n not in IMPLS]

    stream = stream or sys.stderr
    if cases is None:
        cases = matrix_cases(devices=(1, 2), dtypes=("float64",), large_world=()) if quick else matrix_cases()
    if runner is None:
        from parity_tests.running.backends import reserve_tf_devices
        from torchref.pool import get_pool  # the pool once, at the size the matrix needs

        reserve_tf_devices(max(c.devices for c in cases))  # TensorFlow's towers too, before it starts
        get_pool(max(c.devices for c in cases))
    t0 = time.perf_counter()
    tool = versions()
    results: list[CaseResult] = []
    reused = 0
    with tqdm(cases, desc="tfpar matrix", unit="row", file=stream, disable=not progress) as bar:
        for case in bar:
            bar.set_postfix_str(case.name)
            row = _row_file(out, case, impls)
            done = _load_row(row, tool) if resume else None
            if done is not None:
                results.append(done)
                reused += 1
                continue
            result = compare_case(case, impls, runner=runner, skip_unsupported=True)
            # each finished row is on disk at once, so an interrupted run can resume (--resume)
            atomic_write_text(row, json.dumps(jsonable({"versions": tool, "result": result.to_dict()}), allow_nan=False))
            results.append(result)
    bad = [(r.case.name, p.impl, p.verdict.status) for r in results for p in r.pairs if not p.as_expected]
    seconds = time.perf_counter() - t0
    path = write_report(results, out, title="tfpar scenario matrix",
                        meta={"seconds": round(seconds, 1), "rows": len(results)}, trajectories=False)
    if junit is not None:
        from parity_tests.reporting.junit import cases_of, write_junit

        write_junit(junit, [c for r in results for c in cases_of(r)], name="tfpar matrix")
    total = sum(len(r.pairs) for r in results)
    again = f" ({reused} rows reused from an earlier run)" if reused else ""
    also = "" if junit is None else f"; junit: {junit}"
    print(f"{total - len(bad)} / {total} verdicts as expected over {len(results)} cases in {seconds:.0f} s{again}; report: {path}{also}")
    for name, impl, status in bad:
        print(f"  NOT AS EXPECTED: {name}: tf.towers vs {impl}: {status}")
    return 0 if not bad else 1
