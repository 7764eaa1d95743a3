"""Whether a case's TensorFlow runs and its torch runs fit in memory beside each other.

``tfpar compare`` runs a case's TensorFlow runs (in this process, or in a child of the TensorFlow
server) while its torch runs go on in the DDP worker pool, because the pool's ranks are other
processes and would otherwise wait. Each run holds a number of copies of the model: a large model's
two runs together can need more memory than the machine has (GPT-2 small, 124 M parameters, in
float64: 11-12 GB for the TensorFlow run and 7.1-7.3 GB for each of two torch ranks, measured, on a
machine with 23 GB). Then the runs go one after another instead: the same runs with the same
results, later.

The estimate is a count of float64 copies of the P parameters (8 bytes each: the compare's float64
references are its largest runs), measured on the 29.5 M and 124 M GPT
(``benchmarks/bench_gpt.py``, docs/benchmarks.md):

* a TensorFlow tower run on N devices: the variables, Adam's two moments, the N towers' gradients
  and their mean, the capture step's stacked gradients: ``(N + 8) x 8 P`` beyond the TensorFlow
  server's pages (:data:`TF_BASE`);
* a torch rank: its model, DDP's gradient buckets (the ``.grad`` views of them), Adam's two
  moments, its share of the activations and the captured step's copies as they go to files:
  ``7 x 8 P`` beyond torch itself (:data:`TORCH_BASE`), times N ranks.

Activations, which grow with batch x sequence rather than with P, are the margin
(:data:`SHARE`): the two go beside each other when their sum is at most that share of the memory
the machine has available when the compare starts.
"""

from __future__ import annotations

import numpy as np
import psutil

from parity_tests.contract.case import Case

__all__ = ["TF_BASE", "TORCH_BASE", "SHARE", "parameters", "tf_bytes", "torch_bytes", "available_bytes", "fits_beside"]

#: a TensorFlow child's own resident memory before a run: TensorFlow and the server's pages it forked from
TF_BASE = 0.9e9
#: a torch rank's own resident memory before a job: torch, gloo, the worker's interpreter
TORCH_BASE = 0.35e9
#: the share of the available memory the runs' estimates may take together when they go beside each other
SHARE = 0.75


def parameters(case: Case) -> int:
    """P: the number of values in the case's initial weights (parameters and moving statistics)."""
    return sum(int(np.prod(a.shape)) for a in case.init.values())


def tf_bytes(case: Case) -> float:
    """A float64 TensorFlow tower run's resident memory, estimated: ``TF_BASE + (N + 8) 8 P``."""
    return TF_BASE + (case.devices + 8) * 8.0 * parameters(case)


def torch_bytes(case: Case) -> float:
    """A float64 DDP job's resident memory, all N ranks together, estimated: ``N (TORCH_BASE + 7 x 8 P)``."""
    return case.devices * (TORCH_BASE + 7 * 8.0 * parameters(case))


def available_bytes() -> int:
    """The memory the machine has available now (the kernel's estimate, ``MemAvailable``)."""
    return psutil.virtual_memory().available


def fits_beside(case: Case, available: float | None = None) -> bool:
    """Whether a TensorFlow run and a torch job of ``case`` fit in memory at once: their estimates
    together at most :data:`SHARE` of ``available`` bytes (default: what the machine has available now)."""
    if available is None:
        available = available_bytes()
    return tf_bytes(case) + torch_bytes(case) <= SHARE * available
