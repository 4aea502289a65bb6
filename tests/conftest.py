"""Shared test setup: tests never reach the network (Hugging Face Hub lookups fail fast instead), and each
test module starts with JAX's compiled-program caches empty.

`tests/multidevice/` needs 8 devices: it is collected only in a process that has them, the one
`tests/test_multidevice.py` starts with 8 fake CPU devices (the rest of the suite keeps one).
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

MULTIDEVICE_COUNT = 8
collect_ignore = [] if jax.device_count() >= MULTIDEVICE_COUNT else ["multidevice"]


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_module():
    """Without this the whole-suite process keeps every executable of every earlier module (5.6 GB at the
    end), and XLA:CPU segfaulted compiling a Pallas-interpret kernel in the last module, at the same test
    in two runs (AMD EPYC, jax 0.10.2), while that module passed alone and after any one other module."""
    yield
    jax.clear_caches()
