"""The bundled demo model: its card's numbers reproduce, and speculative greedy decoding on it is lossless."""

import json
import sys

import numpy as np
import pytest

from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR, load_pretrained
from mtp_jax.cli import main
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def demo():
    return load_pretrained()


def test_eval_reproduces_the_model_card(tmp_path, capsys):
    """`mtp-jax eval` on the bundled model prints the held-out numbers of its card (`eval.json`)."""
    card = json.loads((DEFAULT_MODEL_DIR / "eval.json").read_text())
    if card.get("python_version", sys.version).split()[0] != sys.version.split()[0]:
        pytest.skip(
            f"the card was measured on the stdlib of Python {card['python_version'].split()[0]}, "
            f"this is {sys.version.split()[0]}: another corpus"
        )
    assert main(["eval", str(DEFAULT_MODEL_DIR), "--data-dir", str(tmp_path / "corpus")]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = card["heldout"]
    assert printed["num_tokens"] == expected["num_tokens"] and printed["num_bytes"] == expected["num_bytes"]
    for name, value in expected.items():
        np.testing.assert_allclose(printed[name], value, rtol=1e-4, err_msg=name)


def test_speculative_greedy_on_the_demo_model_equals_plain_greedy(demo):
    """Every method and K the demo model serves, on a batch mixing prompt lengths: token for token."""
    model, tokenizer = demo
    texts = [
        "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
        "class Foo:\n    def __init__(self",
        "    for i in range(len(items)):\n        if items[i] is None:\n            ",
    ]
    prompts = [tokenizer.encode(t).ids for t in texts]
    assert len({len(p) for p in prompts}) == 3
    kwargs = dict(max_new_tokens=24, max_length=96)
    plain = generate(model, prompts, **kwargs).tokens
    depth = model.config.num_nextn_predict_layers
    configs = [("vanilla", k) for k in range(1, depth + 1)] + [("eagle", k) for k in range(1, 6)]
    accepted = 0
    for method, k in configs:
        result = generate(
            model, prompts, speculative=SpeculativeConfig(method=method, num_speculative_tokens=k), **kwargs
        )
        assert result.tokens == plain, (method, k)
        accepted += result.metrics.num_accepted
    assert accepted > 0  # the trained modules do get drafts accepted
