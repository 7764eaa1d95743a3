"""The real programs of ``examples/real/`` at their test size and, with ``--full``, at the original's.

    .venv/bin/python benchmarks/bench_real_examples.py [--full] [--devices N] [--dtype float64|float32]
        [--only EXAMPLE[,EXAMPLE...]]

Runs each example's README pairs (the program as written, its fixes, its counterpart) with
``compare_case`` and prints, per example: the parameter count, then per pair the verdict,
rule, gap, first step and localisation stage, and the wall time of the whole comparison
(every run of every implementation, the localisation reruns included). ``--full`` builds
each case at the original program's widths in a temporary folder (``make_case.write``):
``multigpu_cnn.py``'s 64/256/512/2048/1024, the notebook's 32/64/64, ``resnet18``'s
64-512 with two blocks a stage (on 32x32 images), CIFAR-10's 24x24 crops and 64/384/192;
the two pytorch/examples DDP programs are at their own size already. The point of
``--full``: the verdicts of the tests (which run the small size) hold at the real one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.contract.case import load_case
from parity_tests.session.comparison import compare_case

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "examples" / "real"

#: example -> the implementations compared (the first is the reference), as in examples/real/README.md
PAIRS: dict[str, list[str]] = {
    "ddp-tutorial-multigpu": ["torch_multigpu.py:multigpu", "tf_towers.py:towers"],
    "ddp-toy-example": ["tf.towers", "torch_example.py:demo_basic"],
    "multigpu-cnn": ["torch.ddp", "tf_multigpu_cnn.py:multigpu_cnn", "tf_multigpu_cnn.py:multigpu_cnn_mean_loss",
                     "tf_multigpu_cnn.py:multigpu_cnn_float64_adam"],
    "custom-training-mirrored": ["tf_custom_training.py:custom_training", "torch_ddp.py:ddp",
                                 "torch_ddp.py:ddp_keras_float32_constants"],
    "imagenet-resnet": ["tf_towers.py:towers", "torch_main.py:main_worker", "torch_main.py:main_worker_ddp",
                        "torch_main.py:main_worker_ddp_mean_loss"],
    # two torch programs that differ only in rounding (batch norm by hand), and the tower port against them
    "imagenet-resnet/rounding": ["torch_main.py:main_worker_ddp_mean_loss",
                                 "torch_bn_by_hand.py:main_worker_ddp_mean_loss_bn_by_hand", "tf_towers.py:towers"],
    "cifar10-multi-gpu": ["torch_ddp.py:ddp", "tf_multi_gpu_train.py:multi_gpu_train_f64",
                          "tf_multi_gpu_train.py:multi_gpu_train_f64_mean_loss",
                          "tf_multi_gpu_train.py:multi_gpu_train_f64_mean_loss_lr",
                          "tf_multi_gpu_train.py:multi_gpu_train_f64_fixed"],
}

#: multigpu_cnn.py's widths: conv 64, 256, 512, dense 2048, 1024 (layers 0, 2, 3, 6, 8 of the case)
CNN_FULL = {0: ("filters", 64), 2: ("filters", 256), 3: ("filters", 512), 6: ("units", 2048), 8: ("units", 1024)}


def _make_case_module(example: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"make_case_{example.replace('-', '_')}",
                                                  REAL / example / "make_case.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_case_folder(example: str, tmp: Path) -> Path:
    """``example``'s case at the original program's size, written under ``tmp``; the test case if it is that already."""
    if example in ("ddp-tutorial-multigpu", "ddp-toy-example"):
        return REAL / example
    folder = tmp / example
    if folder.exists():
        return folder
    folder.mkdir()
    raw = json.loads((REAL / example / "case.json").read_text())
    if example == "multigpu-cnn":
        for index, (field, width) in CNN_FULL.items():
            raw["model"]["layers"][index][field] = width
    elif example == "custom-training-mirrored":
        make = _make_case_module(example)
        make.write(folder, make.FULL)
    elif example == "imagenet-resnet":
        make = _make_case_module(example)
        make.write(folder, **make.FULL)
    elif example == "cifar10-multi-gpu":
        make = _make_case_module(example)
        make.write(folder, **make.FULL)
    raw["name"] += "-full"
    (folder / "case.json").write_text(json.dumps(raw, indent=1))
    return folder


def parameters(case: Any) -> int:
    """Trainable and state entries of the case's initial weights, counted."""
    if case.init is not None:
        return int(sum(np.asarray(v).size for v in case.init.values()))
    return 0


def run(name: str, folder: Path, devices: int, dtype: str) -> None:
    example = name.split("/")[0]
    case = load_case(folder / "case.json").replace(**{"parallel.devices": devices, "dtype": dtype})
    impls = [f"{REAL / example / i.split(':')[0]}:{i.split(':')[1]}" if ":" in i else i for i in PAIRS[name]]
    t = time.perf_counter()
    result = compare_case(case, impls)
    seconds = time.perf_counter() - t
    print(f"{name}: {parameters(case)} weights, {devices} device(s), {dtype}, {seconds:.1f} s")
    for pair in result.pairs:
        v, loc = pair.verdict, pair.localisation or {}
        where = f" step {v.first_step}, {loc.get('stage')}" if v.first_step else ""
        print(f"  {pair.impl.rsplit('/', 1)[-1]:<48} {v.status:<13} {v.rule:<26} gap {v.gap:.3g}{where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the original programs' widths")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--only", default=",".join(PAIRS), help="comma-separated names of PAIRS")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-real-"))
    try:
        for name in args.only.split(","):
            example = name.split("/")[0]
            folder = full_case_folder(example, tmp) if args.full else REAL / example
            run(name, folder, args.devices, args.dtype)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
