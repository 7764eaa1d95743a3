"""What TensorFlow says of the GPUs of this process: its CUDA and cuDNN build, the device names.

Called where TensorFlow already runs (the main process after a TensorFlow run, a
``parity_tests.launch.tf`` worker). Every field is ``None`` (or ``[]``) where there is
nothing to report: a CPU build (``tensorflow-cpu``), no GPU.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["gpu_facts"]


def gpu_facts() -> dict[str, Any]:
    """``{"cuda": "12.5.1" | None, "cudnn": "9" | None, "gpus": [name, ...]}``.

    ``cuda``, ``cudnn``: ``tf.sysconfig.get_build_info()``'s ``cuda_version`` and ``cudnn_version``
    (absent from a CPU build's); ``gpus``: each physical GPU's ``device_name``
    (``tf.config.experimental.get_device_details``), or its TensorFlow name where the details have none.
    """
    build = dict(tf.sysconfig.get_build_info())
    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            gpus.append(str(tf.config.experimental.get_device_details(device).get("device_name", device.name)))
        except Exception:  # details are not available on every platform: the device's own name
            gpus.append(device.name)
    return {"cuda": build.get("cuda_version"), "cudnn": build.get("cudnn_version"), "gpus": gpus}
