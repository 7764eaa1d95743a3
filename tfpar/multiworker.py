"""``tf.multiworker``: the ``tf.mirrored`` loop under ``tf.distribute.MultiWorkerMirroredStrategy``.

One process per worker, the cluster described by ``TF_CONFIG`` (TensorFlow's
own convention)::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]},
                "task": {"type": "worker", "index": 0}}'

Every worker runs :func:`tfpar.mirrored.run_mirrored` with the strategy this
module makes: the same custom training loop, the same loss scaling, the
same optimizer calls. Replica ``r`` (global: worker ``w``'s local replica
``i`` is ``r = w * L + i`` with ``L`` local devices, TensorFlow's
``id_in_cluster`` order, a ``chief`` task first) gets shard ``r`` of every
global batch, as tower ``r`` and DDP rank ``r`` do. The gradients are summed
by TensorFlow's collective all-reduce (``CommunicationImplementation.RING``
over gRPC), not by ``ReductionToOneDevice``: in float64 the sums differ from
``tf.mirrored``'s by rounding only (different order), which the float64 bound
covers.

Local devices per worker (``TensorFlow 2.21``,
``tensorflow/python/distribute/collective_all_reduce_strategy.py``,
``CollectiveAllReduceExtended._initialize_local_devices``): a worker uses
every GPU the process sees (``context.num_gpus()``, which counts *logical*
GPUs: one GPU split into virtual ones gives several), and on a machine
without GPUs exactly one CPU device (``num_local_devices = 1``), however many
logical CPU devices were configured. So on CPU the world size is the number of
workers; on GPU it is workers x local GPUs (:func:`configure_local_devices`
splits GPU 0 when fewer GPUs than local replicas are visible).

The strategy must be created before TensorFlow's runtime starts
(``context.configure_collective_ops`` refuses afterwards: "Collective ops must
be configured at program startup"), so a worker process makes it first and
runs exactly one case; ``tfpar run`` (which has started TensorFlow to count
its tower devices) refuses ``tf.multiworker``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from parity_tests.protocol import settings

from .errors import Unsupported
from .mirrored import run_mirrored
from .refusals import (
    refuse_multiworker as check_supported,  # one place for every refusal (tfpar.refusals)
)

__all__ = ["Cluster", "LOCAL_DEVICES_ENV", "check_supported", "configure_local_devices", "failed_task",
           "make_multiworker_strategy", "parse_tf_config", "run_multiworker"]

#: environment variable: replicas per worker on GPU (default: every visible GPU; CPU: always 1)
LOCAL_DEVICES_ENV = settings.LOCAL_DEVICES.name


@dataclass(frozen=True)
class Cluster:
    """The cluster ``TF_CONFIG`` describes, seen from one task.

    Attributes:
        tasks: ``(job, index, address)`` of every training task in TensorFlow's
            ``id_in_cluster`` order (the ``chief`` first, if any, then the ``worker`` tasks).
        task_type: this task's job, ``worker`` or ``chief``.
        task_index: this task's index within its job.
    """

    tasks: tuple[tuple[str, int, str], ...]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        """Training processes in the cluster (chief included)."""
        return len(self.tasks)

    @property
    def rank(self) -> int:
        """This task's position in :attr:`tasks` (TensorFlow's ``id_in_cluster``)."""
        return next(i for i, (job, idx, _) in enumerate(self.tasks) if (job, idx) == (self.task_type, self.task_index))

    @property
    def is_chief(self) -> bool:
        """The task that writes results: ``chief:0``, or ``worker:0`` when there is no chief."""
        return self.rank == 0

    def name(self, rank: int | None = None) -> str:
        """``worker 1 (127.0.0.1:20002)`` for the task at ``rank`` (default: this one)."""
        job, idx, addr = self.tasks[self.rank if rank is None else rank]
        return f"{job} {idx} ({addr})"


def parse_tf_config(text: str | None) -> Cluster:
    """Read ``TF_CONFIG`` (JSON) into a :class:`Cluster`.

    Raises:
        Unsupported: (field ``TF_CONFIG``) missing, not JSON, no ``worker`` list of
            ``host:port`` strings, or a ``task`` that is not one of the listed tasks.
    """
    field = "TF_CONFIG"
    if not text or not text.strip():
        raise Unsupported(field, "a JSON cluster description in the environment of every worker, e.g. "
                                 '{"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}, '
                                 '"task": {"type": "worker", "index": 0}}')
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise Unsupported(field, f"JSON ({e.msg} at character {e.pos})") from None
    cluster = cfg.get("cluster") if isinstance(cfg, dict) else None
    if not isinstance(cluster, dict) or not isinstance(cluster.get("worker", []), list):
        raise Unsupported(field, 'a "cluster" object with a "worker" list of host:port addresses')
    tasks: list[tuple[str, int, str]] = []
    for job in ("chief", "worker"):
        addrs = cluster.get(job, [])
        if job == "chief" and len(addrs) > 1:
            raise Unsupported(f"{field}.cluster.chief", "at most one chief address")
        for i, a in enumerate(addrs):
            if not isinstance(a, str) or not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", a):
                raise Unsupported(f"{field}.cluster.{job}[{i}]", f"a host:port address, got {a!r}")
            tasks.append((job, i, a))
    if not tasks:
        raise Unsupported(f"{field}.cluster.worker", "at least one host:port address")
    other = sorted(set(cluster) - {"chief", "worker"})
    if other:
        raise Unsupported(f"{field}.cluster", f"only chief and worker jobs for tf.multiworker, got {other}")
    task = cfg.get("task")
    if not isinstance(task, dict) or task.get("type") not in ("chief", "worker") or type(task.get("index")) is not int:
        raise Unsupported(f"{field}.task", 'this process\'s task, {"type": "worker", "index": i}')
    if not any((j, i) == (task["type"], task["index"]) for j, i, _ in tasks):
        raise Unsupported(f"{field}.task", f"a task listed in the cluster; {task['type']} {task['index']} is not")
    return Cluster(tuple(tasks), task["type"], task["index"])


def configure_local_devices(local: int | None = None) -> int:
    """Set up this worker's devices before TensorFlow starts; returns its replica count ``L``.

    GPUs: ``L`` = ``local`` (or ``TFPAR_LOCAL_DEVICES``) if given, else the GPUs visible; when
    fewer GPUs than ``L`` are visible, GPU 0 is split into ``L`` virtual GPUs of
    ``TFPAR_GPU_MEMORY_MB`` (default 1024) each, as :mod:`tfpar.devices` does for towers.
    CPU: ``L`` is 1, the only value ``MultiWorkerMirroredStrategy`` supports there.

    Raises:
        Unsupported: more than one local replica asked for on a machine without GPUs, or
            more local replicas than GPUs with more than one GPU visible.
    """
    local = local if local is not None else settings.local_devices()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        if local not in (None, 1):
            raise Unsupported(LOCAL_DEVICES_ENV, f"1 on a machine without GPUs, got {local}: TensorFlow 2.21's"
                                                 " MultiWorkerMirroredStrategy uses one CPU device per worker"
                                                 " (collective_all_reduce_strategy.py, _initialize_local_devices:"
                                                 " num_local_devices = 1); run more workers instead")
        return 1
    want = local or len(gpus)
    if want == len(gpus):
        for g in gpus:
            tf.config.experimental.set_memory_growth(g, True)
    elif len(gpus) == 1:
        mb = settings.gpu_memory_mb() or 1024
        tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=mb)] * want)
    else:
        raise Unsupported(LOCAL_DEVICES_ENV, f"the number of GPUs this worker sees ({len(gpus)}), or any number"
                                             f" with one GPU (split into virtual GPUs); got {want}")
    return want


def make_multiworker_strategy() -> tf.distribute.MultiWorkerMirroredStrategy:
    """``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``, ring all-reduce; switches op determinism on.

    Call once per process, after :func:`configure_local_devices` and before any other
    TensorFlow op. Joining blocks until every task of the cluster has started.
    ``RING`` rather than ``AUTO``: on GPU, ``AUTO`` picks NCCL, which refuses two ranks
    on one physical GPU (the virtual-GPU split); ``RING`` runs everywhere.
    """
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=ring))
    tf.config.experimental.enable_op_determinism()
    return strategy



def run_multiworker(payload: Mapping[str, Any], strategy: tf.distribute.MultiWorkerMirroredStrategy, *,
                    progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Run a validated case on this worker; every worker returns the same trajectory.

    Args:
        payload: as for :func:`tfpar.mirrored.run_mirrored` (every worker reads the whole case:
            the rows of replica ``r`` are chosen by ``r``, nothing is sent between workers).
        strategy: from :func:`make_multiworker_strategy`; its ``num_replicas_in_sync`` must be
            ``parallel.devices``.
        progress: called with the number of steps done.
    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...], "grad/<name>": [steps, ...]}`` (and
        ``state/<name>``); after every step all replicas' copies of every parameter and state
        were gathered and found bit-identical (else ``RuntimeError`` naming step, replica, parameter).
    """
    check_supported(payload["spec"])
    return run_mirrored(payload, progress=progress, strategy=strategy)


_TASK = re.compile(r"/job:(chief|worker)/replica:\d+/task:(\d+)")


def failed_task(message: str, cluster: Cluster) -> int | None:
    """The rank of the task a TensorFlow error names as unhealthy or unreachable, if it names one.

    TensorFlow's coordination service reports a dead peer as ``The following tasks are
    unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1``; the first task
    named there (or anywhere in the message) other than this one is returned.
    """
    tail = message.split("unhealthy", 1)[-1]
    for text in (tail, message):
        for job, idx in _TASK.findall(text):
            rank = next((r for r, (j, i, _) in enumerate(cluster.tasks) if (j, i) == (job, int(idx))), None)
            if rank is not None and rank != cluster.rank:
                return rank
    return None
