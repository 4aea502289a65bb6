"""`mtp-jax serve` and JAX's persistent compilation cache: the flags `generate` has
(`--compilation-cache DIR`, `--no-compilation-cache`, default `$MTP_JAX_CACHE/jax_cache`), set up before
the engine's warm-up, so that a second start loads the warm-up's programs instead of compiling them.
And the model it serves: `--model DIR`, or the positional MODEL_DIR, not both.

The server itself is not started: `mtp_jax.serving.server.serve` is replaced by a stand-in that
returns at once (tests/test_server.py serves for real)."""

import jax
import jax.monitoring
import pytest
from jax.experimental.compilation_cache import compilation_cache

from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR, load_pretrained, save_pretrained
from mtp_jax.cli import main
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.serving import server
from mtp_jax.training.data import train_tokenizer

CACHE_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(autouse=True)
def compilation_cache_off_afterwards(tmp_path, monkeypatch):
    """The default cache goes to a temporary directory; the process-wide JAX settings are undone after."""
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "cache"))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    before = {name: getattr(jax.config, name) for name in CACHE_SETTINGS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n", "import os\n"] * 20, vocab_size=300)
    config = ModelConfig.from_name(
        "tiny", vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=1, num_nextn_predict_layers=1, eos_token_id=0
    )
    save_pretrained(init_model(config, seed=0), path, tokenizer=tokenizer)
    return path


@pytest.fixture
def served(monkeypatch) -> list[dict]:
    """What each `serve` call found: the compilation cache settings once the engine was warm, and (under
    "served") the engine, tokenizer and model name it was given."""
    calls = []

    def stand_in(engine, tokenizer, name, *, sock, **kwargs):
        calls.append(
            {setting: getattr(jax.config, setting) for setting in CACHE_SETTINGS}
            | {"served": (engine, tokenizer, name)}
        )
        sock.close()

    monkeypatch.setattr(server, "serve", stand_in)
    return calls


def _argv(model_dir, *flags) -> list[str]:
    """serve's argv for a small engine; `model_dir` None: none given as MODEL_DIR (--model in `flags`)."""
    positional = [] if model_dir is None else [str(model_dir)]
    return [
        "serve",
        *positional,
        "--port",
        "0",
        "--speculative",
        "none",
        "--max-batch",
        "1",
        "--max-length",
        "32",
        "--prefill-chunk",
        "8",
        "--log-level",
        "warning",
        *flags,
    ]


def test_serve_help_has_the_compilation_cache_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--compilation-cache DIR" in out and "--no-compilation-cache" in out and "--distributed-timeout" in out


def test_second_start_loads_the_warm_up_from_the_persistent_cache(model_dir, tmp_path, served, capsys):
    cache_dir = tmp_path / "jax_cache"
    assert main(_argv(model_dir, "--compilation-cache", str(cache_dir))) == 0
    assert served[0]["jax_enable_compilation_cache"] and served[0]["jax_compilation_cache_dir"] == str(cache_dir)
    assert len(list(cache_dir.iterdir())) > 0  # the warm-up's programs
    assert "warming up tiny" in capsys.readouterr().err
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **_: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    try:
        jax.clear_caches()  # as in a new process: nothing compiled in memory
        assert main(_argv(model_dir, "--compilation-cache", str(cache_dir))) == 0
    finally:
        jax.monitoring.clear_event_listeners()
    assert len(hits) >= 2  # the engine's steps came from the cache


def test_default_cache_and_no_cache(model_dir, tmp_path, served):
    assert main(_argv(model_dir)) == 0
    assert served[-1]["jax_compilation_cache_dir"] == str(tmp_path / "cache" / "jax_cache")
    assert main(_argv(model_dir, "--no-compilation-cache")) == 0
    assert not served[-1]["jax_enable_compilation_cache"] and served[-1]["jax_compilation_cache_dir"] is None


def test_unusable_cache_dirs(model_dir, tmp_path, monkeypatch, served, capsys):
    (tmp_path / "a_file").write_text("")
    assert main(_argv(model_dir, "--compilation-cache", str(tmp_path / "a_file"))) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"mtp-jax serve: error: --compilation-cache: {tmp_path / 'a_file'} is not a directory"
    )
    assert not served  # refused before the warm-up
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "a_file"))  # the default a_file/jax_cache: a warning
    assert main(_argv(model_dir)) == 0
    assert (
        f"mtp-jax serve: warning: the default compilation cache {tmp_path / 'a_file/jax_cache'} is not a "
        "writable directory (Not a directory): compiling without a persistent cache (set --compilation-cache "
        "DIR or --no-compilation-cache)"
    ) in capsys.readouterr().err.splitlines()
    assert not served[-1]["jax_enable_compilation_cache"]


def test_compilation_cache_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--compilation-cache", "x", "--no-compilation-cache"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --no-compilation-cache: not allowed with argument --compilation-cache\n"
    )


# ----------------------------------------------------------------------------------------------
# The model: --model DIR, or the positional MODEL_DIR


def test_serve_model_flag_serves_that_directory(model_dir, served):
    assert main(_argv(None, "--model", str(model_dir), "--no-compilation-cache")) == 0
    assert main(_argv(model_dir, "--no-compilation-cache")) == 0
    (by_flag, tokenizer, name), (by_positional, _, positional_name) = served[0]["served"], served[1]["served"]
    model, own_tokenizer = load_pretrained(model_dir)
    assert name == positional_name == "tiny"  # the directory's name
    assert by_flag.engine.model.config == by_positional.engine.model.config == model.config  # not the demo model's
    assert model.config != load_pretrained(DEFAULT_MODEL_DIR)[0].config
    assert tokenizer.get_vocab() == own_tokenizer.get_vocab()


def test_serve_model_flag_and_model_dir_together_are_refused(model_dir, tmp_path, served, capsys):
    assert main(_argv(model_dir, "--model", str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err == (
        f"mtp-jax serve: error: MODEL_DIR {model_dir} and --model {tmp_path} both name the model: give one of them\n"
    )
    assert not served  # refused before the model was loaded


def test_serve_model_flag_errors_name_it(tmp_path, served, capsys):
    assert main(_argv(None, "--model", str(tmp_path / "missing"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp-jax serve: error: --model: ") and err.count("\n") == 1 and "missing" in err
    assert not served


def test_page_pool_flags(model_dir, served, capsys):
    """--kv-cache-memory sizes the pool in pages of --page-size tokens (main model and MTP module, every
    layer); --no-prefix-caching turns the prefix cache off; --speculative-policy adaptive compiles a step per
    k; sampled drafts are the server's default; --num-pages and --kv-cache-memory exclude each
    other, and a memory too small for one page is refused naming the flag."""
    from mtp_jax.decode.speculative import SpeculativeConfig
    from mtp_jax.serving.paging import page_bytes

    model, _ = load_pretrained(model_dir)
    per_page = page_bytes(model, SpeculativeConfig(method="eagle", num_speculative_tokens=1), 8)
    config = model.config  # k and v per layer, main model and the one MTP module, float32
    assert (
        per_page == 2 * (config.num_hidden_layers + 1) * 8 * config.num_key_value_heads * config.resolved_head_dim * 4
    )
    flags = ("--no-compilation-cache", "--speculative", "eagle", "--num-speculative-tokens", "1", "--page-size", "8")
    more = ("--kv-cache-memory", str(10 * per_page + 5), "--no-prefix-caching", "--speculative-policy", "adaptive")
    assert main(_argv(model_dir, *flags, *more)) == 0
    engine = served[-1]["served"][0].engine
    assert (engine.num_pages, engine.page_size, engine.prefix_caching) == (10, 8, False)
    assert engine.speculation.variants == (0, 1) and engine.speculative.draft_sampling == "sample"
    assert main(_argv(model_dir, *flags, "--kv-cache-memory", "1")) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--num-pages", "4", "--kv-cache-memory", "1GB"])
