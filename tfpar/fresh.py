"""Each TensorFlow plugin run starts with Keras' process-wide state as a program that imports Keras has it.

A TensorFlow plugin run is a fork of a warm server (``parity_tests.running.tf_worker``) that
imported TensorFlow, Keras and ``tfpar`` and never ran an op or user code; so the run's
TensorFlow state (seeds, ``tf.config`` options, eager settings, devices, the default graph)
is a fresh interpreter's by construction, apart from what the tool sets itself (the case's
devices, op determinism). Keras keeps state that the server's own later imports, or a future
warm-up, could change before the fork, and that user code reads:

* ``keras.config.floatx()``, ``epsilon()``, ``image_data_format()`` (``keras.src.backend.config``'s
  module globals, read from ``~/.keras/keras.json`` at import);
* its *global state* (``keras.src.backend.common.global_state``, thread-local): the global
  dtype policy (``keras.config.dtype_policy()``, the mixed-precision policy of Keras 3), which
  Keras makes from ``floatx()`` the first time anything asks for it and keeps, so
  ``keras.config.set_floatx("float64")`` alone is ignored once it exists; the layer-name
  counters; the global random seed and seed generator; ``clear_session``'s settings.

:func:`snapshot` is taken in the server right after ``import keras`` (what ``import keras``
leaves, the state of a fresh program that imported it), :func:`restore` in each run's
process before the plugin's module is imported. A program that sets ``floatx`` alone and
then builds its model works as it does in a fresh ``python`` (issue 35, item 4:
``tests/test_fresh_runs.py``).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

__all__ = ["snapshot", "restore"]

#: ``keras.src.backend.config``'s settings (module globals set by ``set_floatx`` and its kin)
_CONFIG = ("_FLOATX", "_EPSILON", "_IMAGE_DATA_FORMAT", "_MAX_EPOCHS", "_MAX_STEPS_PER_EPOCH", "_NNX_ENABLED")


def snapshot() -> dict[str, Any] | None:
    """Keras' process-wide settings and global state as they are now (``None`` when Keras is not imported)."""
    if "keras" not in sys.modules:
        return None
    from keras.src.backend import config
    from keras.src.backend.common import global_state

    return {"config": {k: getattr(config, k) for k in _CONFIG if hasattr(config, k)},
            "state": _copied(vars(global_state.GLOBAL_STATE_TRACKER)),
            "settings": _copied(vars(global_state.GLOBAL_SETTINGS_TRACKER))}


def _copied(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each container copied (the name counters are a dict Keras adds to in place: a
    snapshot that shared it would move with it); other values (a policy, a seed) are not changed in place."""
    return {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in values.items()}


def restore(saved: dict[str, Any] | None) -> None:
    """Put Keras' settings and global state back as :func:`snapshot` took them (in this thread: Keras' global
    state is thread-local, and a run's plugin runs in the thread that took the snapshot); no-op for ``None``."""
    if saved is None:
        return
    from keras.src.backend import config
    from keras.src.backend.common import global_state

    for k, v in saved["config"].items():
        setattr(config, k, v)
    for tracker, values in ((global_state.GLOBAL_STATE_TRACKER, saved["state"]),
                            (global_state.GLOBAL_SETTINGS_TRACKER, saved["settings"])):
        for k in list(vars(tracker)):
            delattr(tracker, k)
        for k, v in _copied(values).items():  # copies again: the snapshot serves every later restore
            setattr(tracker, k, v)
