"""The reference pages cannot drift: their measured tables are regenerated from the tests' own tables.

``docs/optimizers.md`` is checked whole in ``test_optimizers.py``; here, every
line that ``python -m parity_tests.tests.test_layers`` and
``python -m parity_tests.tests.test_losses`` print must stand verbatim in
``docs/layers.md`` (the runs are deterministic, so the printed gaps are too).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "layers.md"


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("module", ["parity_tests.tests.test_layers", "parity_tests.tests.test_losses"])
def test_layers_page_tables_are_up_to_date(module, capsys):
    importlib.import_module(module).main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(printed) > 4
    doc = DOC.read_text()
    stale = [line for line in printed if line not in doc]
    assert not stale, f"docs/layers.md is out of date; regenerate with python -m {module}:\n" + "\n".join(stale)
