"""``torchrun ... -m parity_tests.launch.torch CASE --impl torch.ddp --out run.npz`` (see :mod:`parity_tests.launch.torch`)."""

from __future__ import annotations

import contextlib
import os
import sys

from parity_tests.launch.torch import main

if __name__ == "__main__":
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Interpreter finalisation tears gloo contexts down for seconds; everything is written
    # (atomically) and the process group destroyed, so leave at once, as the pool's workers do.
    os._exit(code)
