"""Checkpoint safety: atomic overwriting saves (kill -9 at every step), strict loading of corrupt files.

The kill test runs the save in a child process that SIGKILLs itself just before its n-th
filesystem step (each call of a write, rename, fsync, unlink, ... of the save), for n over the
steps (see the test for which), and checks that the directory then loads as exactly the old or
exactly the new model, with its own tokenizer.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_checkpoint import _params
from test_checkpoint import _random_model as random_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from mtp_jax.checkpoints import (
    CheckpointError,
    atomic_dir,
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from mtp_jax.checkpoints import writing as checkpoint
from mtp_jax.checkpoints.pretrained import load_pretrained, save_pretrained
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.decode.request import MAX_STOP_TOKENS

TINY = ModelConfig.from_name("tiny")  # vocab_size 128
TESTS = pathlib.Path(__file__).parent
T1, T2 = "00ff00ff00ff00ff", "0aaa0aaa0aaa0aaa"  # swap tokens in the saver's format (secrets.token_hex(8))


def _random_model(seed: int):
    return random_model(TINY, seed)


def _same(a, b) -> bool:
    pa, pb = _params(a), _params(b)
    return list(pa) == list(pb) and all(np.array_equal(pa[k], pb[k]) for k in pa)


def _tokenizer(size: int) -> Tokenizer:
    return Tokenizer(WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))


# ----------------------------------------------------------------------------------------------
# Kill -9 during an overwriting save

# Every filesystem step of a save, as (owner, attribute): wrapped so that a hook runs first.
STEP_FUNCTIONS = [
    (os, "mkdir"),
    (os, "rename"),
    (os, "unlink"),
    (os, "rmdir"),
    (shutil, "copyfile"),
    (shutil, "copy2"),
    (pathlib.Path, "write_text"),
    (checkpoint, "save_file"),
    (atomic_dir, "_fsync"),
    (atomic_dir, "_exchange"),
]


def _install_step_hooks(on_step, setattr_=setattr):
    for owner, name in STEP_FUNCTIONS:
        original = getattr(owner, name)

        def hooked(*args, _original=original, _name=name, **kwargs):
            on_step(_name)
            return _original(*args, **kwargs)

        setattr_(owner, name, hooked)


def _child_save(src: str, target: str, kill_at: int, exchange: bool) -> None:
    """In the child: loads the new model from `src`, saves it over `target`, dies before step `kill_at`."""
    model, _ = load_pretrained(src)
    if not exchange:
        atomic_dir._exchange = lambda a, b: False  # the two-rename scheme of other systems
    count = 0

    def on_step(name):
        nonlocal count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    _install_step_hooks(on_step)
    save_pretrained(model, target, tokenizer=pathlib.Path(src) / "tokenizer.json", overwrite=True)


def _save_old(target: pathlib.Path, old_model) -> None:
    save_pretrained(old_model, target, tokenizer=_tokenizer(100))
    (target / "README.md").write_text("card of the old model")  # not a model file: carried over


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_kill_at_every_step_of_an_overwriting_save_leaves_old_or_new(tmp_path, monkeypatch, exchange):
    old_model, new_model = _random_model(1), _random_model(2)
    src = tmp_path / "src"
    save_pretrained(new_model, src, tokenizer=_tokenizer(120))

    # The steps of this save, recorded in-process on a copy of the old checkpoint.
    steps = []
    _save_old(tmp_path / "dry" / "model", old_model)
    with monkeypatch.context() as patch:
        if not exchange:
            patch.setattr(atomic_dir, "_exchange", lambda a, b: False)
        _install_step_hooks(steps.append, patch.setattr)
        save_pretrained(new_model, tmp_path / "dry" / "model", tokenizer=src / "tokenizer.json", overwrite=True)
    swap = steps.index("_exchange" if exchange else "rename") + 1  # 1-based: the first step that moves `path`
    if not exchange:
        assert steps[swap - 1 : swap + 2] == ["rename", "_fsync", "rename"]
    assert steps[0] == "mkdir" and len(steps) < 30

    # Kill before step n, two children at a time (a child imports jax: ~2 s each): for every n that
    # starts or ends a run of like steps (six fsyncs in a row are one kind of point); for the
    # two-rename scheme only from the swap on (before it, both schemes run the same steps).
    points = [
        n
        for n in range(1, len(steps) + 1)
        if n in (1, len(steps)) or steps[n - 2] != steps[n - 1] or steps[n] != steps[n - 1]
    ]
    cases = {n: tmp_path / f"kill{n}" / "model" for n in points if exchange or n >= swap - 1}
    for target in cases.values():
        _save_old(target, old_model)
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_checkpoint_safety as t; "
        "t._child_save(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1')"
    )
    results = {}
    pending = list(cases.items())
    while pending:
        batch, pending = pending[:2], pending[2:]
        children = {
            n: subprocess.Popen(
                [sys.executable, "-c", code, str(src), str(target), str(n), "1" if exchange else "0"],
                stderr=subprocess.PIPE,
            )
            for n, target in batch
        }
        for n, child in children.items():
            _, err = child.communicate(timeout=120)
            results[n] = child.returncode
            assert child.returncode == -signal.SIGKILL, f"kill before step {n}: rc {child.returncode}: {err[-2000:]}"

    for n, target in cases.items():
        model, tokenizer = load_pretrained(target)  # finishes an interrupted two-rename swap
        new = n > swap
        assert _same(model, new_model if new else old_model), f"kill before step {n} ({steps[n - 1]})"
        assert not _same(model, old_model if new else new_model)
        assert tokenizer.get_vocab_size() == (120 if new else 100), n
        assert (target / "README.md").read_text() == "card of the old model"
        # The next save cleans up whatever the kill left.
        save_pretrained(new_model, target, tokenizer=_tokenizer(120), overwrite=True)
        assert [p.name for p in target.parent.iterdir()] == ["model"], n
        assert sorted(p.name for p in target.iterdir()) == [
            "README.md",
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]


def test_interrupted_two_rename_swap_is_recovered_on_load(tmp_path):
    """The state a kill between the two renames leaves: `path` missing, `.name.old-T` and `.name.tmp-T`."""
    old_model, new_model = _random_model(1), _random_model(2)
    save_hf_checkpoint(old_model, tmp_path / f".model.old-{T1}")
    save_hf_checkpoint(new_model, tmp_path / f".model.tmp-{T1}")
    save_hf_checkpoint(old_model, tmp_path / f".model.tmp-{T2}")  # a half-written other save: debris
    assert _same(load_hf_checkpoint(tmp_path / "model"), new_model)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".model.tmp-{T2}", "model"]
    save_hf_checkpoint(old_model, tmp_path / "model", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_recover_names_both_copies_when_it_cannot_rename(tmp_path, monkeypatch):
    (tmp_path / f".model.old-{T1}").mkdir()
    (tmp_path / f".model.tmp-{T1}").mkdir()

    def refuse(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(FileNotFoundError, match=rf"\.model\.tmp-{T1}.*\.model\.old-{T1}"):
        load_hf_checkpoint(tmp_path / "model")


def test_failed_save_leaves_the_old_checkpoint_and_no_temporary_files(tmp_path, monkeypatch):
    old_model = _random_model(1)
    target = tmp_path / "model"
    save_pretrained(old_model, target, tokenizer=_tokenizer(100))
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pathlib.Path, "write_text", fail)  # config.json, after the weights
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(_random_model(2), target, tokenizer=_tokenizer(120), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_overwrite_drops_a_stale_tokenizer_and_refuses_subdirectories(tmp_path):
    target = tmp_path / "model"
    save_pretrained(_random_model(1), target, tokenizer=_tokenizer(100))
    (target / "tokenizer_config.json").write_text("{}")
    save_pretrained(_random_model(2), target, overwrite=True)  # no tokenizer this time
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    (target / "extra").mkdir()
    with pytest.raises(FileExistsError, match="extra"):
        save_hf_checkpoint(_random_model(2), target, overwrite=True)


def test_symlinked_directory_is_replaced_at_its_target(tmp_path):
    real = tmp_path / "real"
    save_hf_checkpoint(_random_model(1), real)
    (tmp_path / "link").symlink_to(real)
    new_model = _random_model(2)
    save_hf_checkpoint(new_model, tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink()
    assert _same(load_hf_checkpoint(real), new_model)


# ----------------------------------------------------------------------------------------------
# Loads during overwriting saves


def _race_pairs():
    """The two saves of the race: (model, tokenizer) with different weights, configs and vocabularies."""
    return [(random_model(TINY, 1), _tokenizer(100)), (random_model(TINY.replace(rope_theta=5e5), 2), _tokenizer(120))]


def _child_save_loop(target: str, seconds: float) -> None:
    """In the child: saves the two `_race_pairs` in turn over `target` for `seconds`; prints "ready" once
    the first is there and the number of saves at the end."""
    pairs = _race_pairs()
    save_pretrained(pairs[0][0], target, tokenizer=pairs[0][1], overwrite=True)
    print("ready", flush=True)
    saves, end = 1, time.monotonic() + seconds
    while time.monotonic() < end:
        model, tokenizer = pairs[saves % 2]
        save_pretrained(model, target, tokenizer=tokenizer, overwrite=True)
        saves += 1
    print(saves, flush=True)


def test_loads_during_overwriting_saves_return_one_save_whole(tmp_path):
    """Each load gets config.json, weights and tokenizer.json of one save, never a mix, while a child
    process overwrites the directory back to back (before `atomic_dir.read_dir`, a third were mixed)."""
    target = tmp_path / "model"
    models = {tokenizer.get_vocab_size(): model for model, tokenizer in _race_pairs()}  # 100 and 120 tokens
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_checkpoint_safety as t; "
        "t._child_save_loop(sys.argv[1], float(sys.argv[2]))"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(target), "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "ready\n", child.stderr.read()
        seen = []
        while child.poll() is None:
            model, tokenizer = load_pretrained(target)
            size = tokenizer.get_vocab_size()
            same = size in models and model.config == models[size].config and _same(model, models[size])
            assert same, f"load {len(seen)}: tokenizer of {size} tokens with another save's config or weights"
            seen.append(size)
        saves = int(child.stdout.read())
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, child.stderr.read()
    assert saves > 20 and len(seen) > 10 and set(seen) == {100, 120}, (saves, len(seen))


# ----------------------------------------------------------------------------------------------
# Tokenizer and model agree


def test_tokenizer_larger_than_the_vocabulary_is_refused_at_save(tmp_path):
    with pytest.raises(ValueError, match="129 tokens, more than the model's vocab_size=128"):
        save_pretrained(_random_model(1), tmp_path / "model", tokenizer=_tokenizer(129))
    _tokenizer(129).save(str(tmp_path / "big.json"))
    with pytest.raises(ValueError, match=r"big\.json has 129 tokens"):
        save_pretrained(_random_model(1), tmp_path / "model", tokenizer=tmp_path / "big.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"bad\.json is not a valid tokenizer\.json"):
        save_pretrained(_random_model(1), tmp_path / "model", tokenizer=tmp_path / "bad.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "big.json"]  # nothing written
    save_pretrained(_random_model(1), tmp_path / "model", tokenizer=_tokenizer(128))  # equal is fine


def test_tokenizer_larger_than_the_vocabulary_is_refused_at_load(tmp_path):
    target = tmp_path / "model"
    save_pretrained(_random_model(1), target, tokenizer=_tokenizer(100))
    _tokenizer(200).save(str(target / "tokenizer.json"))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json has 200 tokens, more than the model's vocab_size=128"):
        load_pretrained(target)


# ----------------------------------------------------------------------------------------------
# Corrupt files


@pytest.fixture
def saved(tmp_path):
    """A sharded checkpoint with a tokenizer."""
    target = tmp_path / "model"
    save_hf_checkpoint(_random_model(1), target, max_shard_size_bytes=40_000)
    _tokenizer(100).save(str(target / "tokenizer.json"))
    return target


def _first_shard(path) -> str:
    return sorted(p.name for p in path.glob("model-*.safetensors"))[0]


def _truncate(path, file):
    data = (path / file).read_bytes()
    (path / file).write_bytes(data[: len(data) // 2])


CORRUPTIONS = {
    "empty shard": (lambda p: (p / _first_shard(p)).write_bytes(b""), "model-00001-of"),
    "truncated shard": (lambda p: _truncate(p, _first_shard(p)), "model-00001-of"),
    "garbage shard": (lambda p: (p / _first_shard(p)).write_bytes(os.urandom(1000)), "model-00001-of"),
    "shard cut by one byte": (
        lambda p: (p / _first_shard(p)).write_bytes((p / _first_shard(p)).read_bytes()[:-1]),
        "model-00001-of",
    ),
    "index not JSON": (
        lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": '),
        "model.safetensors.index.json",
    ),
    "index without weight_map": (
        lambda p: (p / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        "model.safetensors.index.json",
    ),
    "index weight_map a list": (
        lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": []}'),
        "model.safetensors.index.json",
    ),
    "index a list": (lambda p: (p / "model.safetensors.index.json").write_text("[]"), "model.safetensors.index.json"),
    "config not JSON": (lambda p: (p / "config.json").write_text("{'model_type': 'llama'}"), "config.json"),
    "config empty": (lambda p: (p / "config.json").write_bytes(b""), "config.json"),
    "config a list": (lambda p: (p / "config.json").write_text("[1, 2]"), "config.json"),
    "config bytes": (lambda p: (p / "config.json").write_bytes(b"\xff\x00\xfe"), "config.json"),
    "config nested too deeply": (lambda p: (p / "config.json").write_text("[" * 100_000), "config.json"),
    "index nested too deeply": (
        lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000),
        "model.safetensors.index.json",
    ),
    "tokenizer not JSON": (lambda p: (p / "tokenizer.json").write_text("{"), "tokenizer.json"),
    "tokenizer a list": (lambda p: (p / "tokenizer.json").write_text("[]"), "tokenizer.json"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupt_file_is_named(saved, corruption):
    corrupt, file = CORRUPTIONS[corruption]
    corrupt(saved)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(saved)
    assert str(saved / file) in str(info.value)


def test_json_nested_too_deeply_is_a_checkpoint_error(saved):
    (saved / "config.json").write_text("[" * 100_000)  # json.loads: RecursionError
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON: nests too deeply"):
        load_hf_checkpoint(saved)


def test_single_file_and_index_of_another_model_load_the_single_file_with_a_warning(tmp_path):
    """transformers' precedence (modeling_utils: model.safetensors before the index): a warning names both."""
    single, sharded = _random_model(1), _random_model(2)
    save_hf_checkpoint(sharded, tmp_path, max_shard_size_bytes=40_000)
    save_hf_checkpoint(single, tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "model.safetensors")
    with pytest.warns(
        UserWarning,
        match=r"both model\.safetensors and model\.safetensors\.index\.json: "
        r"loading model\.safetensors",
    ):
        loaded = load_hf_checkpoint(tmp_path)
    assert _same(loaded, single) and not _same(loaded, sharded)


def test_more_eos_ids_than_stop_slots_are_refused_at_load(tmp_path):
    save_hf_checkpoint(_random_model(1), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "eos_token_id": list(range(MAX_STOP_TOKENS + 1))}))
    with pytest.raises(
        CheckpointError,
        match=rf"config\.json: eos_token_id lists {MAX_STOP_TOKENS + 1} distinct "
        rf"token ids; generation stops at most at {MAX_STOP_TOKENS}",
    ):
        load_hf_checkpoint(tmp_path)
    ids = [*range(MAX_STOP_TOKENS), 0]  # 16 distinct ids, one repeated: what generation can hold
    (tmp_path / "config.json").write_text(json.dumps({**hf, "eos_token_id": ids}))
    assert load_hf_checkpoint(tmp_path).config.eos_token_id == tuple(ids)


def test_corrupt_single_weights_file_is_named(tmp_path):
    save_hf_checkpoint(_random_model(1), tmp_path)
    _truncate(tmp_path, "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a valid safetensors file"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "shard",
    [
        "../model-00001-of-00004.safetensors",
        "/tmp/model.safetensors",
        "sub/model.safetensors",
        "sub\\model.safetensors",
        "..",
        ".",
        "",
        7,
        None,
    ],
)
def test_index_shard_outside_the_directory_is_refused(saved, shard):
    index_file = saved / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = shard
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a plain file name") as info:
        load_hf_checkpoint(saved)
    assert str(index_file) in str(info.value) and repr(shard) in str(info.value)


def test_index_shard_names_are_the_ones_saved(saved):
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in saved.glob("model-*.safetensors")}
    assert all(set(load_file(saved / f)) for f in set(index["weight_map"].values()))


# ----------------------------------------------------------------------------------------------
# config.json field types: no coercion


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"hidden_size": "64"}, "hidden_size"),
        ({"hidden_size": 64.0}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"vocab_size": [128]}, "vocab_size"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"max_position_embeddings": -5}, "max_position_embeddings"),
        ({"max_position_embeddings": "256"}, "max_position_embeddings"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": 2.0}, "num_key_value_heads"),
        ({"head_dim": "16"}, "head_dim"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
        ({"attention_bias": "false"}, "attention_bias"),
        ({"mlp_bias": 0}, "mlp_bias"),
        ({"model_type": ["llama"]}, "model_type"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"rms_norm_eps": True}, "rms_norm_eps"),
        ({"rope_theta": "10000"}, "rope_theta"),
        ({"rope_scaling": ["linear", 2.0]}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, r"rope_scaling\.factor"),
        ({"rope_scaling": {"rope_type": 3, "factor": 2.0}}, r"rope_scaling\.rope_type"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}},
            r"rope_scaling\.original_max_position_embeddings",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}}, r"rope_scaling\.truncate"),
        ({"rope_parameters": "default"}, "rope_parameters"),
        ({"hidden_act": 1}, "hidden_act"),
        ({"dtype": ["float32"]}, "dtype"),
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"eos_token_id": [2, "3"]}, r"eos_token_id\[1\]"),
        ({"bos_token_id": 1.0}, "bos_token_id"),
        ({"num_nextn_predict_layers": 1.0}, "num_nextn_predict_layers"),
        ({"num_nextn_predict_layers": "1"}, "num_nextn_predict_layers"),
        ({"num_nextn_predict_layers": 1, "mtp_hidden_after_norm": "true"}, "mtp_hidden_after_norm"),
        ({"sliding_window": "16"}, "sliding_window"),
        # Non-finite or zero values; only an absent (or null) field takes the default.
        ({"initializer_range": float("nan")}, "initializer_range must be a finite number, got nan"),
        ({"initializer_range": 0}, "initializer_range must be a finite number > 0, got 0"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number, got inf"),
        ({"rope_theta": 10**400}, "rope_theta must be a finite number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, r"rope_scaling\.factor must be a finite"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 0}},
            r"rope_scaling\.beta_fast must be a finite number > 0, got 0\.0",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_slow": 0.0}}, r"rope_scaling\.beta_slow"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale": float("nan")}}, r"rope_scaling\.mscale"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0}},
            r"rope_scaling\.low_freq_factor",
        ),
        # rope_theta in two places (transformers 4.x reads the top level, 5.x the RoPE dict) must agree.
        (
            {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
            r"rope_theta=10000\.0 and rope_parameters\.rope_theta=500000\.0 differ",
        ),
        (
            {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
            r"rope_theta=10000\.0 and rope_scaling\.rope_theta=500000\.0 differ",
        ),
        (
            {
                "rope_theta": None,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            r"rope_scaling\.rope_theta=500000\.0 and rope_parameters\.rope_theta=1000000\.0 differ",
        ),
        (
            {"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}},
            r"partial_rotary_factor=0\.5 and rope_parameters\.partial_rotary_factor=1\.0 differ",
        ),
        ({"model_type": "qwen2", "attention_bias": True, "use_sliding_window": "yes"}, "use_sliding_window"),
    ],
)
def test_wrong_json_types_are_errors_naming_the_field(tmp_path, changes, field):
    hf = {**config_to_hf(TINY), **changes}
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf)
    save_hf_checkpoint(_random_model(1), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=field) as info:
        load_hf_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_rope_theta_is_read_from_whichever_field_gives_it():
    base = {k: v for k, v in config_to_hf(TINY).items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    linear = {"rope_type": "linear", "factor": 2.0}
    for fields in (
        {"rope_theta": 5e5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_theta": 5e5, "rope_scaling": linear},
        {"rope_scaling": {**linear, "rope_theta": 5e5}},
        {"rope_theta": 5e5, "rope_scaling": linear, "rope_parameters": {**linear, "rope_theta": 5e5}},
    ):
        assert config_from_hf({**base, **fields}).rope_theta == 5e5, fields
    assert config_from_hf(base).rope_theta == 10000.0


def test_config_values_are_checked_in_code_too():
    with pytest.raises(ValueError, match="initializer_range must be a finite number > 0, got nan"):
        TINY.replace(initializer_range=float("nan"))
    with pytest.raises(ValueError, match=r"rope_scaling\.factor must be a finite number > 0, got inf"):
        RopeScaling(rope_type="linear", factor=float("inf"))
    with pytest.raises(ValueError, match=r"rope_scaling\.beta_fast must be a finite number > 0, got 0"):
        RopeScaling(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, beta_fast=0)
    yarn = config_from_hf(
        {**config_to_hf(TINY), "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": None}}
    )
    assert (yarn.rope_scaling.beta_fast, yarn.rope_scaling.beta_slow) == (32.0, 1.0)  # absent: the defaults
    assert RopeScaling(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, mscale=0.0).mscale == 0.0


def test_ints_are_accepted_for_float_fields_and_null_means_absent():
    hf = {
        **config_to_hf(TINY),
        "rope_theta": 10000,
        "rms_norm_eps": 1,
        "max_position_embeddings": None,
        "num_key_value_heads": None,
        "tie_word_embeddings": None,
    }
    config = config_from_hf(hf)
    assert (config.rope_theta, config.rms_norm_eps) == (10000.0, 1.0)
    assert isinstance(config.rope_theta, float)
    assert config.max_position_embeddings == 2048 and config.num_key_value_heads == TINY.num_attention_heads
    assert config.tie_word_embeddings is False
