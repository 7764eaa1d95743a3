"""``parity_tests.running.gpu``: the driver, GPU names and each framework's CUDA and cuDNN, read without a
framework import in the wrong process, and nothing failing where there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parity_tests.running import gpu

# as the driver prints them: nvidia-smi on two H100s; the proprietary kernel module's version file; the open
# module's and a GPU's information file as an H200 printed them (driver 580.159.04, the device check of
# 2026-11-28 in docs/ci.md)
SMI = "550.54.15, NVIDIA H100 80GB HBM3\n550.54.15, NVIDIA H100 80GB HBM3\n"
PROC_VERSION = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
PROC_VERSION_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
                     "GCC version:  gcc version 15.3.0 (GCC) \n")
PROC_INFO = ("Model: \t\t NVIDIA H200\nIRQ:   \t\t 41\nGPU UUID: \t GPU-7c26a0bd-a839-c206-c7d9-44035bfe0e99\n"
             "Video BIOS: \t 96.00.a5.00.1a\nBus Type: \t PCIe\n")
# TensorFlow 2.x's generated build_info.py on a CUDA build
TF_GPU_BUILD = ("import collections\n\nbuild_info = collections.OrderedDict([('cpu_compiler', '/usr/bin/clang-18'), "
                "('cuda_compute_capabilities', ['sm_60', 'compute_90']), ('cuda_version', '12.5.1'), "
                "('cudnn_version', '9'), ('is_cuda_build', True), ('is_rocm_build', False), ('is_tensorrt_build', False)])\n")
TORCH_GPU_VERSION = "from typing import Optional\n\n__version__ = '2.13.0+cu128'\ndebug = False\ncuda: Optional[str] = '12.8'\n"


def test_the_drivers_reports_are_read():
    assert gpu.parse_nvidia_smi(SMI) == ("550.54.15", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
    assert gpu.parse_nvidia_smi("") == (None, [])
    assert gpu.parse_proc_version(PROC_VERSION) == "550.54.15"
    assert gpu.parse_proc_version(PROC_VERSION_OPEN) == "580.159.04"
    assert gpu.parse_proc_version("no driver here") is None
    assert gpu.parse_proc_information(PROC_INFO) == "NVIDIA H200"


def test_nvidia_smi_on_path_is_asked_the_documented_query(tmp_path, monkeypatch):
    """A program named nvidia-smi first on PATH answers only the query the module documents (any other
    arguments: a failing status), so the call's arguments are checked too. (Its output is the format the
    real one prints; the device check of docs/ci.md ran the real one.)"""
    smi = tmp_path / "nvidia-smi"
    (tmp_path / "answer.txt").write_text(SMI)
    smi.write_text("#!/bin/sh\n"
                   '[ "$1" = "--query-gpu=driver_version,name" ] && [ "$2" = "--format=csv,noheader" ] || exit 6\n'
                   f"cat '{tmp_path / 'answer.txt'}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu.driver_facts.__wrapped__() == {"driver": "550.54.15", "gpus": ["NVIDIA H100 80GB HBM3"] * 2,
                                              "source": "nvidia-smi"}


def test_without_a_driver_every_field_says_none(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setattr(gpu, "PROC", tmp_path / "no-driver")
    assert gpu.driver_facts.__wrapped__() == {"driver": None, "gpus": [], "source": None}


def test_a_cuda_build_is_read_from_the_frameworks_files(tmp_path):
    (tmp_path / "build_info.py").write_text(TF_GPU_BUILD)
    (tmp_path / "version.py").write_text(TORCH_GPU_VERSION)
    assert gpu.tf_build(tmp_path / "build_info.py") == {"cuda": "12.5.1", "cudnn": "9", "gpus": None, "live": False}
    assert gpu.torch_build(tmp_path / "version.py") == {"cuda": "12.8", "cudnn": None, "gpus": None, "live": False}
    assert gpu.tf_build(tmp_path / "missing.py") is None


@pytest.mark.parametrize(("framework", "say"), [
    ("torch", "import torch; print(json.dumps(torch.version.cuda))"),
    ("tensorflow", "import tensorflow as tf; print(json.dumps(tf.sysconfig.get_build_info().get('cuda_version')))"),
])
def test_the_installed_builds_read_without_an_import_are_what_the_frameworks_say(framework, say):
    """The file read here and the framework's own answer, in a process of its own (this one imports neither
    for it): the same CUDA version, ``null`` for a CPU build."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", f"import json; {say}"], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    build = gpu.torch_build() if framework == "torch" else gpu.tf_build()
    assert build["cuda"] == json.loads(out.stdout.strip().splitlines()[-1])


def test_flatten_compares_only_what_both_runs_could_know():
    recorded = {"driver": "550.54.15", "gpus": ["NVIDIA H100 80GB HBM3"], "source": "nvidia-smi",
                "torch": {"cuda": "12.8", "cudnn": 91002, "gpus": ["NVIDIA H100 80GB HBM3"], "live": True},
                "tensorflow": {"cuda": "12.5.1", "cudnn": "9", "gpus": None, "live": False}}
    assert gpu.flatten(recorded) == {"driver": "550.54.15", "names": "NVIDIA H100 80GB HBM3", "torch.cuda": "12.8",
                                     "torch.cudnn": "91002", "torch.gpus": "NVIDIA H100 80GB HBM3",
                                     "tensorflow.cuda": "12.5.1"}
    assert gpu.flatten({"driver": None, "gpus": [], "source": None, "torch": None}) == {"driver": "none", "names": "none"}
    assert gpu.flatten(None) == {}


def test_the_torch_side_reports_from_its_rank_and_this_process_never_imports_torch(pool):
    """A torch run's facts come from a pool rank (torchref.gpu); this process imports no torch for them."""
    facts = gpu.gpu_facts(live="torch")
    assert facts["torch"]["live"] is True and set(facts["torch"]) == {"cuda", "cudnn", "gpus", "live"}
    assert facts["torch"]["cuda"] == gpu.torch_build()["cuda"]  # the rank's torch is the installed one
    assert isinstance(facts["torch"]["gpus"], list)
    assert "torch" not in sys.modules
