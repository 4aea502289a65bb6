"""Shared test setup: tests never reach the network (Hugging Face Hub lookups fail fast instead), and each
test module starts with JAX's compiled-program caches empty."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_module():
    """Without this the whole-suite process keeps every executable of every earlier module (5.6 GB at the
    end), and XLA:CPU segfaulted compiling a Pallas-interpret kernel in the last module, at the same test
    in two runs (AMD EPYC, jax 0.10.2), while that module passed alone and after any one other module."""
    yield
    jax.clear_caches()
