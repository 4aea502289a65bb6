"""Tests that need 8 devices; `tests/test_multidevice.py` runs them with 8 fake CPU devices."""

import jax
import pytest


def pytest_configure(config):
    if jax.device_count() < 8:
        raise pytest.UsageError(
            "tests/multidevice needs 8 devices: run it with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_multidevice.py does)"
        )
