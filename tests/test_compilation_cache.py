"""`mtp_jax.enable_compilation_cache`: the Python API's way to the persistent cache the CLI uses."""

import jax
import jax.monitoring
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

import mtp_jax


@pytest.fixture
def restore_jax_cache_config():
    names = (
        "jax_enable_compilation_cache",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    yield
    compilation_cache.reset_cache()
    for name, value in before.items():
        jax.config.update(name, value)


def test_a_program_compiled_once_is_loaded_from_the_directory(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "root"))
    assert mtp_jax.enable_compilation_cache() == tmp_path / "root" / "jax_cache"
    directory = mtp_jax.enable_compilation_cache(tmp_path / "mine")
    assert directory == tmp_path / "mine" and directory.is_dir()
    events = []
    jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
    try:
        f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
        f(jnp.ones(7)).block_until_ready()
        assert any(directory.iterdir())  # the program was written
        jax.clear_caches()
        f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
        f(jnp.ones(7)).block_until_ready()
    finally:
        jax.monitoring.clear_event_listeners()
    assert "/jax/compilation_cache/cache_hits" in events


def test_an_unusable_directory_is_named(tmp_path, restore_jax_cache_config):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^path: .*file is not a directory"):
        mtp_jax.enable_compilation_cache(tmp_path / "file")
