"""torch plugins that fail on one rank under torchrun (``parity_tests/tests/test_launch.py``).

The MLP case of ``parity_tests/tests/helpers.py``, trained by the correct DDP
port of ``torch_plugins``; on the last rank only, step 2 raises, step 1 hangs
(sleeps while the other ranks wait for it in a collective), or step 2 loses
its update (the replicas fall out of sync). No TensorFlow here: every rank
imports this file.
"""

from __future__ import annotations

import os
import signal
import time

import torchref
from parity_tests.tests.plugins.torch_plugins import BOTH, _train

HANG_S = 600.0  # far past any test's timeout: only the launcher's fault handling ends it


@torchref.plugin.distributed(dtypes=BOTH)
def last_rank_raises(run):
    def change(k, net):
        if k == 2 and run.rank == run.world_size - 1:
            raise RuntimeError("injected fault on the last rank")

    _train(run, change=change)


@torchref.plugin.distributed(dtypes=BOTH)
def last_rank_hangs(run):
    def change(k, net):
        if k == 1 and run.rank == run.world_size - 1:
            time.sleep(HANG_S)  # the others wait in the loss allreduce of step 1

    _train(run, change=change)


@torchref.plugin.distributed(dtypes=BOTH)
def last_rank_skips_step_2(run):
    def change(k, net):
        if k == 2 and run.rank == run.world_size - 1:
            for p in net.parameters():
                p.grad.zero_()

    _train(run, change=change)


@torchref.plugin.distributed(dtypes=BOTH)
def last_rank_dies(run):
    def change(k, net):
        if k == 2 and run.rank == run.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no report: the process is simply gone

    _train(run, change=change)
