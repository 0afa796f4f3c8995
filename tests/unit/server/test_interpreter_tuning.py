"""Once the model is loaded the server freezes the heap (no full collection rescans the startup objects) and, for
a model on a device, shortens the interpreter's thread switch interval (issue 22)."""

from __future__ import annotations

import gc
import sys
from types import SimpleNamespace

import pytest

from server.app import DEVICE_SWITCH_INTERVAL_MS, _tune_interpreter
from server.settings import Settings


@pytest.fixture
def restore():
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)
    gc.unfreeze()


@pytest.mark.parametrize("kv_cache,flag,expected_ms", [("device", None, DEVICE_SWITCH_INTERVAL_MS),
                                                       ("host", None, None), ("host", 2.0, 2.0)])
def test_heap_frozen_and_switch_interval(restore, kv_cache, flag, expected_ms):
    before = sys.getswitchinterval()
    # (the profile's interval, as engine.placement reports it: ep.profiles.DeviceProfile.switch_interval_ms)
    engine = SimpleNamespace(placement=SimpleNamespace(
        kv_cache=kv_cache, switch_interval_ms=DEVICE_SWITCH_INTERVAL_MS if kv_cache == "device" else None))
    _tune_interpreter(Settings(gil_switch_interval_ms=flag), engine)
    assert gc.get_freeze_count() > 1000
    assert sys.getswitchinterval() == pytest.approx(before if expected_ms is None else expected_ms / 1000)
