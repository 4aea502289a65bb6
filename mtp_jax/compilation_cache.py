"""JAX's persistent compilation cache for mtp_jax's programs: a second process loads what the first compiled.

`mtp-jax generate` and `mtp-jax serve` turn it on by default (`--compilation-cache DIR`,
`--no-compilation-cache`); from Python, `mtp_jax.enable_compilation_cache()` does the same for the
rest of the process. The default directory is `cache_root() / "jax_cache"`.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import jax


def cache_root() -> pathlib.Path:
    """Where mtp_jax keeps what it can rebuild (tokenized corpora, compiled programs): `$MTP_JAX_CACHE`,
    else `$XDG_CACHE_HOME/mtp_jax`, else `~/.cache/mtp_jax`."""
    if os.environ.get("MTP_JAX_CACHE"):
        return pathlib.Path(os.environ["MTP_JAX_CACHE"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "mtp_jax"


def default_compilation_cache_dir() -> pathlib.Path:
    """The persistent compilation cache's default directory: `cache_root() / "jax_cache"`."""
    return cache_root() / "jax_cache"


def cache_dir_problem(path: pathlib.Path) -> str | None:
    """Why `path` cannot hold the compilation cache (it is a file, cannot be created or is not writable);
    None when it can. Creates the directory."""
    if path.exists() and not path.is_dir():
        return f"{path} is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{path} is not a writable directory ({error.strerror or error})"
    return None


def set_compilation_cache(path: pathlib.Path | None) -> None:
    """Points JAX's persistent compilation cache at `path` for this process (None: no cache). Every
    compiled program is cached, however quick its compile or small its executable."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # an earlier call in this process may have used another directory
    jax.config.update("jax_enable_compilation_cache", path is not None)
    jax.config.update("jax_compilation_cache_dir", None if path is None else str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> pathlib.Path:
    """Turns on JAX's persistent compilation cache in `path` (default `default_compilation_cache_dir()`,
    created if needed) for the rest of this process, as the CLI does: the jitted prefill, step and loop
    of a `DecodeEngine` (and everything else jax compiles) are then loaded from disk by the next process
    with the same shapes instead of compiled again. Returns the directory.

    Raises ValueError naming `path` when it is a file, cannot be created or is not writable.
    """
    directory = default_compilation_cache_dir() if path is None else pathlib.Path(path)
    problem = cache_dir_problem(directory)
    if problem:
        raise ValueError(f"path: {problem}")
    set_compilation_cache(directory)
    return directory
