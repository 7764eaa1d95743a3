"""The reference pages cannot drift: their measured tables are regenerated from the tests' own tables.

``docs/optimizers.md`` is checked whole in ``test_optimizers.py``; here, every
line that ``python -m parity_tests.tests.test_layers``, ``... test_layers_vocabulary`` and
``python -m parity_tests.tests.test_losses`` print must stand verbatim in
``docs/layers.md`` (the runs are deterministic, so the printed gaps are too).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "layers.md"
# A gap at rounding level (the float64 bound is 1e-10; these agree to ~1e-15) depends on the
# CPU's vector width and summation order, not on the code: its digits and the array that
# happened to hold the largest one are compared as "rounding level". Anything larger is a
# measured difference and must stand verbatim.
_ROUNDING = re.compile(r"\| ([0-9.]+e-1[3-9]|0) \([^)]*\) \|")


def _normalise(line: str) -> str:
    return _ROUNDING.sub("| rounding level |", line)


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("module", ["parity_tests.tests.test_layers", "parity_tests.tests.test_losses",
                                    "parity_tests.tests.test_layers_vocabulary"])
def test_layers_page_tables_are_up_to_date(module, capsys):
    importlib.import_module(module).main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(printed) > 4
    doc = {_normalise(line) for line in DOC.read_text().splitlines()}
    stale = [line for line in printed if _normalise(line) not in doc]
    assert not stale, f"docs/layers.md is out of date; regenerate with python -m {module}:\n" + "\n".join(stale)


def test_the_implementations_table_is_the_engines_declarations():
    """docs/implementations.md's engines table is generated from tfpar.engines and torchref.engines."""
    from parity_tests.protocol.engine import table
    from parity_tests.running.builtins import SPECS

    text = (DOC.parent / "implementations.md").read_text()
    start = text.index("<!-- engines table:")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end of engines table -->")
    assert text[start:end] == table(SPECS), "regenerate the table: parity_tests.protocol.engine.table(SPECS)"
