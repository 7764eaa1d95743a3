"""The TensorFlow server that every TensorFlow plugin run is forked from (``running/tf_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from parity_tests.running.backends import RunError
from parity_tests.running.harness import run_impl
from parity_tests.running.tf_worker import TFWorker, get_worker, shutdown_worker
from parity_tests.tests.helpers import MLP, make
from parity_tests.tests.processes import HANG_DEADLINE, children, wait_gone

TF = f"{Path(__file__).resolve().parent / 'plugins' / 'tf_plugins.py'}"


def test_a_run_that_dies_is_one_line_and_the_server_serves_the_next():
    case = make(MLP, steps=3)
    run_impl(case, f"{TF}:good")
    server = get_worker(start=False).pid
    with pytest.raises(RunError, match=r"exits_at_step_2 failed: its process died \(exit code 3\) without reporting"):
        run_impl(case, f"{TF}:exits_at_step_2")
    assert get_worker(start=False).pid == server  # the child died, not the server
    assert len(run_impl(case, f"{TF}:good")["loss"]) == 3


def test_each_run_is_a_new_process_and_closing_leaves_none():
    shutdown_worker()
    run_impl(make(MLP, steps=1), f"{TF}:good")
    worker = get_worker(start=False)
    server = psutil.Process(worker.pid)
    assert children(server) == []  # the run's process is gone once it reported (the server waited for it)
    shutdown_worker()
    assert wait_gone([server]) == []


def test_a_server_that_cannot_start_is_one_line(monkeypatch):
    worker = TFWorker()
    monkeypatch.setattr("sys.executable", "/bin/false")  # exits at once: nothing answers
    try:
        with pytest.raises(RuntimeError, match="the TensorFlow server died"):
            worker.run({"inspect": True})
    finally:
        worker.close()


NO_TF_IN_THE_PARENT = """
import sys
from parity_tests.contract.case import case_from_dict
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP

if __name__ == "__main__":
    case = case_from_dict(dict(MLP, steps=1, parallel=dict(MLP["parallel"], devices=2)))
    plugins = "parity_tests/tests/plugins/"
    result = compare_case(case, [plugins + "tf_plugins.py:good", plugins + "torch_plugins.py:ddp"])
    print(result.parity, "tensorflow" in sys.modules, "keras" in sys.modules)
"""


def test_a_tensorflow_plugin_is_never_imported_into_the_tools_process():
    """Resolved and run in the server's children: the tool's process imports neither TensorFlow nor the
    plugin's module (whose top level could change it), and pays no TensorFlow import of its own."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", NO_TF_IN_THE_PARENT], capture_output=True, text=True, timeout=HANG_DEADLINE,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["True", "False", "False"], out.stdout
