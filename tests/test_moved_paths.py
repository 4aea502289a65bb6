"""The 0.1 module paths (`mtp_jax._moved`): each imports, warns, and is the module that holds its names now."""

import importlib
import json
import subprocess
import sys
import warnings

import mtp_jax
from mtp_jax._moved import MOVED

_CHECK = """
import importlib, json, warnings
import mtp_jax
from mtp_jax._moved import MOVED
out = {}
for old, new in sorted(MOVED.items()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert all(w.filename == "<string>" for w in caught if w.category is DeprecationWarning), caught
    if isinstance(new, str):
        real = importlib.import_module(new)
        out[old] = messages, module is real, real.__spec__.name == new
    else:  # a module of its own holding each new module's public names
        sources = [importlib.import_module(n) for n in new]
        same = all(getattr(module, n) is getattr(s, n) for s in sources for n in getattr(s, "__all__", ())
                   or [n for n in vars(s) if not n.startswith("_")])
        out[old] = messages, same, all(s.__spec__.name == n for s, n in zip(sources, new))
print(json.dumps(out))
"""


def test_an_old_path_is_the_new_module_with_a_warning():
    out = json.loads(subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True).stdout)
    assert sorted(out) == sorted(MOVED)
    for old, (messages, same, specs_intact) in out.items():
        new = MOVED[old] if isinstance(MOVED[old], str) else " and ".join(MOVED[old])
        assert len(messages) == 1 and messages[0].startswith(f"{old} moved to {new};"), (old, messages)
        assert same and specs_intact, old


def test_old_names_resolve_and_the_generate_function_stays():
    with warnings.catch_warnings():  # (the warnings themselves: the test above)
        warnings.simplefilter("ignore", DeprecationWarning)
        for old in ("mtp_jax.checkpoint", "mtp_jax.engine", "mtp_jax.speculative", "mtp_jax.pretrained"):
            importlib.import_module(old)
    from mtp_jax.checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from mtp_jax.engine import DecodeEngine, init_state
    from mtp_jax.pretrained import TextStream, load_pretrained, stream_text
    from mtp_jax.speculative import SpeculativeConfig

    assert (DecodeEngine, SpeculativeConfig) == (mtp_jax.DecodeEngine, mtp_jax.SpeculativeConfig)
    assert load_hf_checkpoint.__module__ == "mtp_jax.checkpoints.reading"
    assert save_hf_checkpoint.__module__ == "mtp_jax.checkpoints.writing"
    assert init_state.__module__ == "mtp_jax.decode.state"
    assert (TextStream, stream_text, load_pretrained) == (
        mtp_jax.TextStream,
        mtp_jax.stream_text,
        mtp_jax.load_pretrained,
    )
    assert callable(mtp_jax.generate) and mtp_jax.generate.__module__ == "mtp_jax.decode.generation"
