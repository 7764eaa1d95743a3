"""Replayable failures: written, loadable, and bit-identical to the failing case."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import load_case
from parity_tests.testing.failures import record_failure, replayable
from parity_tests.tests.helpers import SOFTMAX, make


def test_replayable_writes_the_case_and_names_it(tmp_path):
    case = make(SOFTMAX)
    with pytest.raises(AssertionError) as info:
        with replayable(case, tmp_path):
            raise AssertionError("boom")
    msg = str(info.value)
    assert msg.startswith("boom\nreplay: tfpar compare ")
    path = msg.split("tfpar compare ", 1)[1]
    back = load_case(path)
    assert back.spec["model"] == case.spec["model"] and np.array_equal(back.x, case.x)
    assert all(np.array_equal(back.init[k], case.init[k]) for k in case.init)


def test_same_case_same_folder_and_no_write_without_failure(tmp_path):
    case = make(SOFTMAX)
    assert record_failure(case, tmp_path) == record_failure(case, tmp_path)
    with replayable(case, tmp_path / "other"):
        pass
    assert not (tmp_path / "other").exists()


def test_the_replay_command_names_the_implementations_compared(tmp_path):
    case = make(SOFTMAX)
    with pytest.raises(AssertionError) as info:
        with replayable(case, tmp_path, impls=["torch.ddp", "my_towers.py:train"]):
            raise AssertionError("boom")
    assert str(info.value).endswith(" --impls torch.ddp,my_towers.py:train")
