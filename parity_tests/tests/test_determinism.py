"""``torchref.determinism``: what every torch rank computes under, paid for once in the forkserver."""

from __future__ import annotations

from torchref import _pool_testfns as fns
from torchref.jobs import PRELOAD


def test_the_forkserver_imports_the_settings_before_it_forks_a_rank() -> None:
    # its import configures the server; a rank would otherwise import torch._inductor.config itself
    assert "torchref.determinism" in PRELOAD


def test_every_rank_sets_the_eager_and_the_inductor_determinism_flags(pool) -> None:
    """One intra-op thread and ``torch.use_deterministic_algorithms(True)``, which also sets
    inductor's flag: a plugin's ``torch.compile`` in a rank compiles deterministic kernels."""
    for r in pool.run(fns.determinism, None, 4):
        assert r == {"threads": 1, "deterministic": True, "inductor": True}, r
