"""`examples/pmap_decode.py`: pmapped speculative decoding, one sub-batch per device, equals
single-device `generate` token for token (greedy, eagle K = 2)."""

import importlib.util
import pathlib

import jax
import numpy as np

from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import init_model

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "pmap_decode.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("pmap_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pmap_eagle_greedy_equals_single_device_generate():
    assert jax.local_device_count() == 8
    example = _load_example()
    model = init_model(ModelConfig.from_name("tiny", num_key_value_heads=4, num_nextn_predict_layers=2), seed=0)
    rng = np.random.default_rng(0)
    # 10 prompts on 8 devices: 2 rows each, the last 6 rows padding; lengths 3 .. 21 give sub-batches
    # of prompt buckets 16 and 32, which the example pads to one.
    prompts = [rng.integers(1, 128, n).tolist() for n in (3, 21, 5, 9, 17, 4, 12, 20, 7, 16)]
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    kwargs = dict(max_new_tokens=12, max_length=48, speculative=spec)

    results = example.pmap_decode(model, prompts, **kwargs)
    tokens = example.pmap_generate(model, prompts, **kwargs)
    expected = generate(model, prompts, **kwargs)

    assert len(results) == 8 and all(len(r.tokens) == 2 for r in results)
    assert tokens == expected.tokens
    # devices 5 .. 7 and the second row of device 4 decode copies of the last prompt
    assert [r.tokens[1] for r in results[4:]] == [expected.tokens[-1]] * 4
    assert sum(r.metrics.num_steps for r in results) > 0
