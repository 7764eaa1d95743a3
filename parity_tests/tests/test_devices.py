"""Device selection: listing, the first N devices, refusals, and a v1 Session that sees them all."""

from __future__ import annotations

import pytest


def test_list_devices_names_physical_and_logical_devices():
    import tensorflow as tf

    from tfpar import available_devices, list_devices

    devices = list_devices()
    physical = [d for d in devices if d.kind == "physical"]
    logical = [d for d in devices if d.kind == "logical"]
    assert {d.name for d in physical} == {d.name for d in tf.config.list_physical_devices()}
    assert any(d.device_type == "CPU" for d in physical)
    # every tower device is listed as a logical device
    assert set(available_devices()) <= {d.name for d in logical}
    gpus = [d for d in physical if d.device_type == "GPU"]
    if not gpus:
        # CPU-only: the logical CPU devices stand in for towers, with no GPU fields
        assert available_devices() == [d.name for d in logical if d.device_type == "CPU"]
        assert all(d.memory_limit_mb is None and d.memory_growth is None for d in devices)
    else:
        # each GPU has memory growth or a limit set
        assert all(d.memory_growth or d.memory_limit_mb is not None for d in gpus) or any(
            d.memory_limit_mb is not None for d in logical if d.device_type == "GPU")


@pytest.mark.parametrize("n", [1, 3, 8])
def test_tower_devices_are_the_first_n(n):
    from tfpar import available_devices, tower_devices

    assert tower_devices(n) == available_devices()[:n]
    assert len(set(tower_devices(n))) == n


def test_asking_for_more_devices_than_configured_raises():
    from tfpar import DeviceError, available_devices, tower_devices

    have = len(available_devices())
    with pytest.raises(DeviceError, match=f"{have + 1} devices asked for, but this process has {have}"):
        tower_devices(have + 1)


def test_a_v1_session_sees_every_configured_device():
    import tensorflow as tf

    from tfpar import available_devices, session_config

    cfg = session_config()
    assert cfg.allow_soft_placement
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph, config=cfg) as sess:
        seen = {d.name.split("/", 3)[-1] for d in sess.list_devices()}
    assert {d.rsplit("/", 1)[-1] for d in available_devices()} <= {s.rsplit("/", 1)[-1] for s in seen}
