"""Output (issue 26, item 6): report file names safe and unique for any implementation name, and progress
that never shares a line with an error or a verdict (``session/progress.py``)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from parity_tests.cli import main
from parity_tests.reporting.report import _safe
from parity_tests.session.progress import LineProgress, run_bar
from parity_tests.tests.helpers import MLP
from parity_tests.tests.processes import HANG_DEADLINE

HERE = Path(__file__).resolve().parent / "plugins"


@pytest.mark.parametrize("name", ["torch.ddp@float64", "tf.towers@float32", "tf.single@float64+keras-f32"])
def test_a_builtins_file_name_keeps_its_plain_form(name):
    assert _safe(name) == name.replace("@", "_").replace("+", "_")


def test_plugin_names_give_visible_unique_bounded_file_names():
    names = ["../plugins/x.py:train@float32", "./x.py:train@float32", ".x.py:train@float32", "_x.py:train@float32",
             "a/b.py:f@float64", "a_b.py:f@float64", "a b.py:f@float64", "recorded:../run.npz@float64",
             "/" + "deep/" * 80 + "x.py:train@float64"]
    files = [_safe(n) for n in names]
    assert len(set(files)) == len(files), files  # unique
    for f in files:
        assert not f.startswith((".", "-", "_")) and "/" not in f and len(f) <= 129, f
    assert _safe(names[0]) == _safe(names[0])  # the same name, the same file
    assert files[-1].endswith("x.py_train_float64-" + files[-1][-8:])  # the end of a long path is what is kept


def test_a_plugin_path_starting_with_dotdot_writes_visible_trajectories(tmp_path, monkeypatch, capsys, pool):
    (tmp_path / "plugins").mkdir()
    shutil.copy(HERE / "tf_plugins.py", tmp_path / "plugins" / "tf_plugins.py")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "case.json").write_text(json.dumps(dict(MLP, steps=2)))
    monkeypatch.chdir(tmp_path / "work")
    status = main(["compare", "case.json", "--impls", "../plugins/tf_plugins.py:good,torch.ddp", "--report", "rep"])
    assert status == 0, capsys.readouterr()
    files = sorted(p.name for p in (tmp_path / "work" / "rep" / "trajectories").iterdir())
    assert files and not [f for f in files if f.startswith(".")], files
    assert any(f.startswith("plugins_tf_plugins.py_good_float64-") and f.endswith(".npz") for f in files), files


def test_in_a_log_each_run_is_a_line_and_an_error_starts_its_own(tmp_path, capsys, pool):
    case = tmp_path / "case.json"
    case.write_text(json.dumps(MLP))
    status = main(["compare", str(case), "--impls", f"{HERE / 'tf_plugins.py'}:raises_at_step_3,torch.ddp"])
    err = capsys.readouterr().err  # captured: not a terminal
    assert status == 3 and "\r" not in err  # a plugin that raises: an error, nothing judged
    lines = err.splitlines()
    runs = [line for line in lines if line.startswith("mlp: run ")]
    assert runs and all(": run " in r and "/" in r for r in runs)
    failed = [line for line in lines if "tfpar: run failed: " in line]
    assert len(failed) == 1 and failed[0].startswith("tfpar: run failed: "), lines


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_is_cleared_before_what_follows():
    term = _Terminal()
    bar = run_bar(3, "case", term)
    assert not isinstance(bar, LineProgress)
    bar.set_postfix_str("tf.towers@float64")
    bar.update(1)
    bar.close()
    text = term.getvalue()
    assert "case" in text and text.endswith("\r")  # cleared: the cursor is back at the start of an empty line
    assert text.split("\r")[-2].strip() == ""  # the last thing drawn is blanks over the bar


def test_line_progress_counts_runs_and_is_silent_once_closed():
    out = io.StringIO()
    bar = run_bar(2, "case", out)
    bar.set_postfix_str("a@float64")
    bar.update(1)
    bar.total += 1
    bar.set_postfix_str("b@float64")
    bar.close()
    bar.set_postfix_str("c@float64")
    assert out.getvalue() == "case: run 1/2: a@float64\ncase: run 2/3: b@float64\n"


def test_a_tensorflow_plugins_own_output_comes_through_in_whole_lines(tmp_path, capsys, pool):
    """The run's stdout and stderr are relayed line by line (``contract.relay``), an unfinished last
    line at the run's end on a line of its own: never inside a progress line."""
    case = tmp_path / "case.json"
    case.write_text(json.dumps(dict(MLP, steps=2)))
    assert main(["compare", str(case), "--impls", f"{HERE / 'tf_plugins.py'}:prints,torch.ddp"]) == 0
    out, err = capsys.readouterr()
    assert "a line from the plugin (float64)\n" in out
    assert "\nan unfinished line" in "\n" + err and "\r" not in err
    for line in err.splitlines():
        assert line == "an unfinished line" or line.startswith("mlp: run "), line


def test_a_runs_output_on_a_terminal_clears_the_bar_first_and_redraws_it_after(monkeypatch):
    from tqdm import tqdm

    from parity_tests.protocol.relay import write_output

    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    bar = tqdm(total=3, desc="case", unit="run", leave=False, file=term)
    bar.set_postfix_str("my.py:train@float64")
    before = len(term.getvalue())
    write_output(2, b"a line of the plugin's\n")
    text = term.getvalue()
    at = text.index("a line of the plugin's\n")
    assert at > before and text[at - 1] == "\r"  # the line starts where the cleared bar was
    assert "case" in text[at:]  # and the bar is drawn again below it
    bar.close()


def test_a_ddp_plugins_ranks_output_comes_through_in_whole_lines(tmp_path, capsys, pool):
    case = tmp_path / "case.json"
    case.write_text(json.dumps(dict(MLP, steps=2, parallel=dict(MLP["parallel"], devices=2))))
    assert main(["compare", str(case), "--impls", f"torch.ddp,{HERE / 'torch_plugins.py'}:prints"]) == 0
    out, err = capsys.readouterr()
    assert "rank 0 says hello\n" in out and "rank 1 says hello\n" in out
    for line in err.splitlines():
        assert line in ("rank 0 unfinished", "rank 1 unfinished") or line.startswith("mlp: run "), line
    assert "\nrank 1 unfinished\n" in "\n" + err


def test_a_fresh_command_shows_none_of_tensorflows_start_up_chatter(tmp_path):
    """TensorFlow logs through absl before its log level is read; the tool starts it quietly
    (running.backends.quiet_stderr). The check is on a fresh process: the registry imports
    tfpar.engines (no TensorFlow) first, which must not pass for TensorFlow having started."""
    import subprocess
    import sys

    from parity_tests.protocol.relay import BENIGN

    case = tmp_path / "case.json"
    case.write_text(json.dumps(dict(MLP, steps=1)))
    env = {k: v for k, v in __import__("os").environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-m", "parity_tests.cli", "run", str(case), "--impl", "tf.single",
                          "--out", str(tmp_path / "t.npz")], capture_output=True, text=True, timeout=HANG_DEADLINE, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    shown = [b.decode() for b in BENIGN if b.decode() in out.stderr]
    assert not shown, out.stderr[-2000:]
