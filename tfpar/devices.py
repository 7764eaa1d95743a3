"""Device set-up for the tower engine: done once per process, before TensorFlow starts.

TensorFlow fixes its device list when its runtime initialises, so logical
devices must be configured before the first op runs. We configure the largest
count the process will need and hand out the first N to N towers: on a CPU-only
machine 64 logical CPU devices by default (``MAX_DEVICES``; measured on the
2-core machine, 2026-11-22: configuring 64 costs what 8 cost, 0.03-0.06 s, with
the same resident memory and thread count, and a 4-tower run is no slower, so
one count serves every case), with GPUs 8; ``TFPAR_DEVICES`` overrides the
default, and a caller that knows its cases asks for ``count`` (the larger of the
two is made: ``parity_tests`` asks for the largest N of the run before
TensorFlow starts). Where GPUs are present they
are used: one tower per GPU, or, when there are fewer GPUs than towers, GPU 0
split into virtual GPUs with a memory limit each (``TFPAR_GPU_MEMORY_MB``,
default 1024). GPUs that are not split get that limit when
``TFPAR_GPU_MEMORY_MB`` is set, memory growth otherwise.
``CUDA_VISIBLE_DEVICES`` is respected because TensorFlow only sees those GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parity_tests.protocol import settings
from parity_tests.protocol.errors import TfparError

__all__ = [
    "DEFAULT_DEVICES",
    "MAX_DEVICES",
    "DeviceError",
    "DeviceInfo",
    "available_devices",
    "configure_devices",
    "list_devices",
    "session_config",
    "tower_devices",
]

DEFAULT_DEVICES = 8  #: with GPUs: each virtual GPU holds its own memory, so make few unless asked
MAX_DEVICES = 64  #: without GPUs: logical CPU devices cost nothing measurable (module docstring)
_configured: list[str] | None = None


class DeviceError(TfparError, RuntimeError):
    """More towers were asked for than this process can place."""


def _want(gpus: bool) -> int:
    return settings.devices(DEFAULT_DEVICES if gpus else MAX_DEVICES)


def configure_devices(count: int | None = None) -> list[str]:
    """Configure at least ``count`` tower devices once; later calls return the same list.

    The count made is the larger of ``count`` and the default (``TFPAR_DEVICES``,
    else 64 logical CPU devices without GPUs, 8 with). Once TensorFlow's runtime
    has started the list is fixed: a later, larger ``count`` changes nothing
    (:func:`tower_devices` then refuses N past it, naming both numbers).
    Also switches TensorFlow's op determinism on, so repeated runs are bit-identical.

    Returns:
        device names usable in ``tf.device``, e.g. ``["/device:CPU:0", ...]``.
    """
    global _configured
    if _configured is not None:
        return _configured
    gpus = tf.config.list_physical_devices("GPU")
    count = max(count or 0, _want(bool(gpus)))
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
        if gpus and len(gpus) < count:
            mb = settings.gpu_memory_mb() or 1024
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=mb)] * count
            )
        elif gpus and settings.gpu_memory_mb() is not None:
            # one tower per GPU, each capped at the limit asked for
            mb = settings.gpu_memory_mb()
            for g in gpus:
                tf.config.set_logical_device_configuration(g, [tf.config.LogicalDeviceConfiguration(memory_limit=mb)])
        else:
            for g in gpus:
                tf.config.experimental.set_memory_growth(g, True)
    except RuntimeError:
        # the runtime was already initialised by someone else: use what exists
        pass
    tf.config.experimental.enable_op_determinism()
    logical_gpus = tf.config.list_logical_devices("GPU")
    logical = logical_gpus if logical_gpus else tf.config.list_logical_devices("CPU")
    _configured = [d.name for d in logical]
    return _configured


def available_devices() -> list[str]:
    """The tower devices this process can use (configures them on first call)."""
    return list(configure_devices())


def tower_devices(n: int) -> list[str]:
    """The first ``n`` tower devices.

    Raises:
        DeviceError: if ``n`` exceeds what was configured (names both numbers).
    """
    devs = configure_devices()
    if n > len(devs):
        raise DeviceError(
            f"{n} devices asked for, but this process has {len(devs)} "
            f"(TensorFlow fixes its devices when it starts: set TFPAR_DEVICES={n}, or call "
            f"configure_devices({n}), before the first TensorFlow op)"
        )
    return devs[:n]


@dataclass(frozen=True)
class DeviceInfo:
    """One device TensorFlow can see.

    Attributes:
        name: ``/physical_device:GPU:0`` (physical) or ``/device:CPU:3`` (logical,
            usable in ``tf.device``).
        device_type: ``CPU`` or ``GPU``.
        kind: ``physical`` or ``logical``.
        memory_limit_mb: the configured memory limit of a (virtual) GPU, where one was set.
        memory_growth: for physical GPUs, whether memory growth is on; ``None`` otherwise.
        description: the GPU's model name where TensorFlow reports it, else ``""``.
    """

    name: str
    device_type: str
    kind: str
    memory_limit_mb: int | None = None
    memory_growth: bool | None = None
    description: str = ""


def list_devices() -> list[DeviceInfo]:
    """Every physical and logical device of this process (configures them on first call).

    GPUs are only those ``CUDA_VISIBLE_DEVICES`` leaves visible (TensorFlow
    never sees the others). On a CPU-only machine the list is the one physical
    CPU and the logical CPU devices that stand in for towers.
    """
    configure_devices()
    out: list[DeviceInfo] = []
    limits: dict[str, int | None] = {}  # logical GPU "GPU:k" -> its limit
    for d in tf.config.list_physical_devices():
        growth, limit, desc = None, None, ""
        if d.device_type == "GPU":
            growth = bool(tf.config.experimental.get_memory_growth(d))
            confs = tf.config.get_logical_device_configuration(d) or []
            limit = confs[0].memory_limit if len(confs) == 1 else None
            desc = str(tf.config.experimental.get_device_details(d).get("device_name", ""))
            # logical GPUs are numbered in physical order; an unsplit GPU makes one
            for c in confs or [None]:
                limits[f"GPU:{len(limits)}"] = c.memory_limit if c is not None else None
        out.append(DeviceInfo(d.name, d.device_type, "physical", limit, growth, desc))
    for d in tf.config.list_logical_devices():
        short = d.name.split("device:")[-1]
        out.append(DeviceInfo(d.name, d.device_type, "logical", limits.get(short) if d.device_type == "GPU" else None))
    return out


def session_config() -> tf.compat.v1.ConfigProto:
    """A ``tf.compat.v1.Session`` config that sees the devices :func:`configure_devices` made.

    A Session given its own ``ConfigProto`` starts from one CPU device
    (measured: 1 device instead of 8); the eager context's config carries the
    logical-device set-up, so we start from it and add ``allow_soft_placement``
    (ops without a kernel on a tower's device fall back, as the classic tower programs configure).
    """
    configure_devices()
    cfg = tf.compat.v1.ConfigProto()
    try:
        # private, but it is exactly what Session(config=None) uses
        from tensorflow.python.eager import context

        cfg.CopyFrom(context.context().config)
    except (ImportError, AttributeError):
        cfg.device_count["CPU"] = len(tf.config.list_logical_devices("CPU"))
        cfg.device_count["GPU"] = len(tf.config.list_logical_devices("GPU"))
    cfg.allow_soft_placement = True
    return cfg
