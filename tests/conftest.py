"""Shared test setup: tests never reach the network (Hugging Face Hub lookups fail fast instead), and each
test module starts with JAX's compiled-program caches empty. The speculative-decoding tests' models and plain-greedy
references (`models`, `plain`) are session fixtures, so the files sharing them build and decode them once.

`tests/multidevice/` needs 8 devices: it is collected only in a process that has them, the one
`tests/test_multidevice.py` starts with 8 fake CPU devices (the rest of the suite keeps one).
"""

import functools
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


# ---------------------------------------------------------------------------------------------
# The speculative-decoding tests' models (`speculative_helpers`): session-scoped, so test_acceptance,
# test_drafters and test_engine share them and each plain-greedy reference is computed once.


@pytest.fixture(scope="session")
def models():
    """{style: {"random": model, "scripted": model}}."""
    from speculative_helpers import CFG, make_model, scripted

    parallel = CFG.replace(mtp_style="parallel")
    return {
        "deepseek": {"random": make_model(CFG, 1, 0.3), "scripted": scripted(CFG, 2)},
        "parallel": {"random": make_model(parallel, 3, 0.3), "scripted": scripted(parallel, 4)},
    }


@pytest.fixture(scope="session")
def plain(models):
    """plain(style, name, impl): plain greedy decoding of PROMPTS by a model, what speculation must
    reproduce (computed once each)."""
    from speculative_helpers import MAX_NEW, PROMPTS, S, main_twin, with_impl

    from mtp_jax.decode.generation import generate

    @functools.cache
    def run(style_: str, name: str, impl: str = "reference"):
        model = main_twin(with_impl(models[style_][name], impl))
        return generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])

    return run


@pytest.fixture(scope="session")
def hybrid_models():
    """{kind: {"random": model, "scripted": model}} for the Qwen3.5-shaped hybrids (`speculative_helpers.HYBRID`,
    kind "dense", and `HYBRID_MOE`, kind "moe"): random weights (std 0.3) where the recurrent state decides
    tokens, scripted ones where the acceptance pattern is built in."""
    from speculative_helpers import HYBRID_CONFIGS, hybrid_scripted, make_model

    return {
        kind: {"random": make_model(config, 11 + i, 0.3), "scripted": hybrid_scripted(config, 21 + i)}
        for i, (kind, config) in enumerate(HYBRID_CONFIGS.items())
    }
