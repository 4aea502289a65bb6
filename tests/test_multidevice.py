"""Runs `tests/multidevice/` (sharded decoding, training, examples) in its own pytest process with 8
fake CPU devices (`--xla_force_host_platform_device_count=8`), so this process keeps one device."""

import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_the_multidevice_tests_pass_on_8_fake_cpu_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(HERE / "multidevice")],
        env=env,
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"skipped|xfail|deselected", summary), output
