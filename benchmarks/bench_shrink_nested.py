"""Shrinking a generated architecture with the real judge: the smallest network in which a planted mistake shows.

    .venv/bin/python benchmarks/bench_shrink_nested.py [max_examples]

Draws nested models (``parity_tests.testing.strategies.nested_cases``, one device) and asks hypothesis for
the smallest case in which ``tfpar compare`` of ``torch.ddp`` against a port with every layer norm's epsilon
100x the case's (``parity_tests/tests/plugins/nested_torch.py:every_layer_norm_epsilon``) is a divergence.
Prints the network found at first and the shrunk one, the localisation of the shrunk one, how many
comparisons the search made and the seconds it took. ``make test`` checks the same shrinking with an
in-process torch forward pass instead of the comparison (``tests/test_properties_nested.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, find, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parity_tests.session.comparison import compare_case  # noqa: E402
from parity_tests.testing.strategies import nested_cases  # noqa: E402

PLUGIN = Path(__file__).resolve().parents[1] / "parity_tests" / "tests" / "plugins" / "nested_torch.py"


def main() -> None:
    max_examples = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seen: list = []

    def diverges(case) -> bool:  # noqa: ANN001
        status = compare_case(case, ["torch.ddp", f"{PLUGIN}:every_layer_norm_epsilon"], stages=False).pairs[0].verdict.status
        seen.append((case, status))
        return status == "divergence"

    t0 = time.perf_counter()
    found = find(nested_cases(devices=st.just(1)), diverges,
                 settings=settings(max_examples=max_examples, database=None, deadline=None,
                                   suppress_health_check=list(HealthCheck)))
    seconds = time.perf_counter() - t0
    first = next(c for c, s in seen if s == "divergence")
    print("first failing network:", json.dumps(first.spec["model"]["layers"]))
    print("shrunk network:       ", json.dumps(found.spec["model"]["layers"]),
          "input", found.spec["model"]["input_shape"], "rows", found.spec["data"]["global_batch"],
          "steps", found.spec["steps"])
    where = compare_case(found, ["torch.ddp", f"{PLUGIN}:every_layer_norm_epsilon"]).pairs[0].localisation
    print("localisation:", where["stage"], where["name"], "|", where["explanation"])
    print(f"{len(seen)} comparisons, {seconds:.1f} s")


if __name__ == "__main__":
    main()
