"""Device set-up for the tower engine: done once per process, before TensorFlow starts.

TensorFlow fixes its device list when its runtime initialises, so logical
devices must be configured before the first op runs. We configure the largest
count the process will need (8 logical CPU devices by default; ``TFPAR_DEVICES``
overrides) and hand out the first N to N towers. Where GPUs are present they
are used: one tower per GPU, or, when there are fewer GPUs than towers, GPU 0
split into virtual GPUs with a memory limit each (``TFPAR_GPU_MEMORY_MB``,
default 1024). Memory growth is switched on for GPUs that are not split.
``CUDA_VISIBLE_DEVICES`` is respected because TensorFlow only sees those GPUs.
"""

from __future__ import annotations

import os

import tensorflow as tf

__all__ = ["DeviceError", "configure_devices", "tower_devices", "available_devices", "DEFAULT_DEVICES"]

DEFAULT_DEVICES = 8
_configured: list[str] | None = None


class DeviceError(RuntimeError):
    """More towers were asked for than this process can place."""


def _want() -> int:
    try:
        return max(1, int(os.environ.get("TFPAR_DEVICES", DEFAULT_DEVICES)))
    except ValueError:
        return DEFAULT_DEVICES


def configure_devices(count: int | None = None) -> list[str]:
    """Configure ``count`` tower devices once; later calls return the same list.

    Also switches TensorFlow's op determinism on, so repeated runs are bit-identical.

    Returns:
        device names usable in ``tf.device``, e.g. ``["/device:CPU:0", ...]``.
    """
    global _configured
    if _configured is not None:
        return _configured
    count = count or _want()
    gpus = tf.config.list_physical_devices("GPU")
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
        if gpus and len(gpus) < count:
            mb = int(os.environ.get("TFPAR_GPU_MEMORY_MB", "1024"))
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=mb)] * count
            )
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
            f"(set TFPAR_DEVICES={n} before the first TensorFlow op to make more)"
        )
    return devs[:n]
