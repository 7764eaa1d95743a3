"""Write the case files of this folder from their builders (``parity_tests.reporting.architectures``).

    .venv/bin/python examples/architectures/write_cases.py

``parity_tests/tests/test_architectures.py`` checks that every ``<name>/case.json`` here equals its
builder's output, so edit the builder and rerun this script rather than editing a file by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from parity_tests.reporting.architectures import FULL_SIZE

HERE = Path(__file__).resolve().parent


def main() -> None:
    for name, raw in FULL_SIZE.items():
        folder = HERE / name
        folder.mkdir(exist_ok=True)
        (folder / "case.json").write_text(json.dumps(raw, indent=1) + "\n")
        print(folder / "case.json")


if __name__ == "__main__":
    main()
