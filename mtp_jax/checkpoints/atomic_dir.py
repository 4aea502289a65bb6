"""Atomic replacement of a directory: the new contents are written beside it, then swapped in.

`replace_dir(P)` for a target `P = parent/name`, with a fresh random token T (16 lowercase hex
digits, `secrets.token_hex(8)`):

  1. Write: the caller fills the new, empty sibling `parent/.name.tmp-T`; plain files the caller
     does not own are copied over from the old `P`; every file, the directory and `parent` are
     fsynced.
  2. Swap, in one of two ways:
     - exchange (Linux, `renameat2(RENAME_EXCHANGE)`): `P` and `.name.tmp-T` trade places in one
       atomic step; `.name.tmp-T` now holds the old contents. A `P` that does not exist yet is
       created by one rename, which is atomic as well.
     - two renames (other systems, or a filesystem that refuses the exchange): `P` ->
       `.name.old-T`, then `.name.tmp-T` -> `P`.
  3. Clean up: fsync `parent`, delete the old contents.

What a kill (SIGKILL, power loss after the fsyncs) leaves at each point:
  - during or after 1: `P` is the old directory, untouched; `.name.tmp-T` is debris.
  - after the exchange, before or during 3: `P` is the new directory; `.name.tmp-T` (the old
    contents, perhaps half deleted) is debris.
  - between the two renames: `P` is missing, `.name.old-T` is the old directory and `.name.tmp-T`
    the complete new one (the first rename only happens once 1 is done). `recover(P)` finishes the
    swap by renaming `.name.tmp-T` to `P`; loading and saving a checkpoint call it first.
  - after the second rename: `P` is the new directory; `.name.old-T` is debris.

So `P` (after `recover`, in the one state that needs it) always holds the old or the new
contents, complete. Debris, every `.name.tmp-T` / `.name.old-T` sibling of an existing `P` whose T
has exactly the token's format, is deleted by the next `replace_dir(P)` (a `.name.tmp-abc` of the
user's is not ours and stays): one writer per target at a time.

Readers (`read_dir`) see one version of `P` whole, even during a swap: on Linux every file is read
through a descriptor of the directory `P` named when the read began (`/proc/self/fd/N/file`),
which the exchange moves but does not change; a read that the clean-up of 3 cuts short, and
elsewhere any read during which `P` changed, starts again from `P`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}
_TOKEN_BYTES = 8  # T = secrets.token_hex(8): 16 lowercase hex digits, the only sibling names treated as ours
READ_ATTEMPTS = 5  # `read_dir`: attempts before a directory replaced during each of them is an error
_T = TypeVar("_T")


def _sibling(path: Path, kind: str, token: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{token}"


def _siblings(path: Path) -> dict[str, dict[str, Path]]:
    """kind ("tmp" / "old") -> token -> path, over the leftover siblings of `path`."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-([0-9a-f]{{{2 * _TOKEN_BYTES}}})")
    found: dict[str, dict[str, Path]] = {"tmp": {}, "old": {}}
    if path.parent.is_dir():
        for entry in path.parent.iterdir():
            match = pattern.fullmatch(entry.name)
            if match:
                found[match[1]][match[2]] = entry
    return found


def _fsync(path: Path) -> None:
    """Flushes one file or directory to disk (directories only on POSIX, where that is defined)."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two existing paths in one atomic step; False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def recover(path: str | os.PathLike) -> bool:
    """Finishes a swap that a kill interrupted between its two renames; True when it did.

    Acts only when `path` is missing and a `.name.old-T` / `.name.tmp-T` pair of siblings exists
    (see the module docstring): renames `.name.tmp-T` to `path` and deletes `.name.old-T`.

    Raises:
      FileNotFoundError naming both siblings when the rename fails (a read-only filesystem, ...).
    """
    path = Path(path).resolve()
    if path.exists():
        return False
    found = _siblings(path)
    for token in sorted(set(found["old"]) & set(found["tmp"])):
        new, old = found["tmp"][token], found["old"][token]
        try:
            os.rename(new, path)
        except OSError as error:
            raise FileNotFoundError(
                f"{path} is missing: a save was interrupted between its renames; the new directory is "
                f"{new} and the old one {old}: rename one of them to {path} ({error})"
            ) from error
        _fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        return True
    return False


def _moved(path: Path, pinned: os.stat_result) -> bool:
    """Whether `path` no longer names the directory `pinned` (held open, so its inode is not reused)."""
    try:
        return not os.path.samestat(os.stat(path), pinned)
    except OSError:
        return True


def _pinned_root(fd: int, pinned: os.stat_result) -> Path | None:
    """`/proc/self/fd/<fd>`, a path that resolves names inside the open directory `fd`; None without /proc."""
    root = Path(f"/proc/self/fd/{fd}")
    try:
        return root if os.path.samestat(os.stat(root), pinned) else None
    except OSError:
        return None


def read_dir(path: str | os.PathLike, read: Callable[[Path], _T], *, attempts: int = READ_ATTEMPTS) -> _T:
    """`read(root)`, with every file that `read` opens as `root / name` taken from one version of `path`.

    A `replace_dir(path)` running meanwhile cannot mix two versions (one file from the old
    checkpoint, another from the new):
      - Linux: `root` is `/proc/self/fd/N`, N a descriptor of the directory that `path` names when
        the attempt starts. Names resolve inside that directory even after the swap has moved it
        away, so everything comes from one save. The saver's clean-up may delete the old files
        before `read` opens them; `read` then fails (FileNotFoundError, a CheckpointError, ...),
        and since `path` now names another directory (complete by then) the attempt is repeated.
        `read` should open its files early (before its slow work) so that this stays rare.
      - elsewhere (no /proc): `root` is `path` itself, and an attempt counts only if `path` still
        names the directory it named at the start (held open meanwhile, so its inode number is
        not reused): a read during which a swap happened is repeated, whether it failed or not.
        The limit: a writer that swaps in a new version faster than one read takes starves the
        reader (the OSError below), where on Linux reads only repeat when the clean-up wins a race.
    `recover(path)` runs before each attempt. When `path` cannot be opened as a directory,
    `read(path)` runs once, to raise the caller's own error for a missing directory.

    Raises:
      whatever `read` raises when `path` did not change during that attempt (a real error); an
      OSError naming `path` when it was replaced during each of `attempts` attempts (a writer
      overwriting it faster than it can be read).
    """
    path = Path(path)
    failure: BaseException | None = None
    for _ in range(attempts):
        recover(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # missing, not a directory, or a system that cannot open directories (Windows)
            return read(path)
        try:
            pinned = os.fstat(fd)
            root = _pinned_root(fd, pinned) or path
            try:
                result = read(root)
            except (OSError, ValueError) as error:
                if not _moved(path, pinned):
                    raise
                failure = error
                continue
            if root != path or not _moved(path, pinned):
                return result
            failure = None
        finally:
            os.close(fd)
    raise OSError(
        f"{path} was replaced by a concurrent save during each of {attempts} attempts to read it"
    ) from failure


def _remove_debris(path: Path) -> None:
    for kind in _siblings(path).values():
        for leftover in kind.values():
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def replace_dir(path: str | os.PathLike, *, overwrite: bool, owned: Callable[[str], bool]) -> Iterator[Path]:
    """Yields an empty temporary directory that atomically replaces `path` when the block succeeds.

    The scheme and what a kill leaves are in the module docstring. `path` is resolved first
    (symlinks followed): a symlink stays and its target directory is replaced. Plain files of the
    old `path` for which `owned(name)` is False are carried over into the new directory (unless
    the block wrote a file of that name); files it owns are dropped. On an exception in the block
    the temporary directory is deleted and `path` is left as it was.

    Raises:
      FileExistsError: `path` exists and is not a directory; `path` is a non-empty directory and
        `overwrite` is False; or it holds an entry that is neither owned nor a plain file (a
        subdirectory, a symlink, ...), which the swap would lose.
    """
    path = Path(path).resolve()  # an absolute path whose parent is the real parent ("." has none)
    recover(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    kept = []
    if path.is_dir():
        entries = sorted(path.iterdir())
        if entries and not overwrite:
            raise FileExistsError(f"{path} is not empty; pass overwrite=True to replace its checkpoint")
        for entry in entries:
            if owned(entry.name):
                continue
            if entry.is_symlink() or not entry.is_file():
                raise FileExistsError(
                    f"{path} holds {entry.name}, which is not a plain file: overwriting "
                    "would lose it; move it away first"
                )
            kept.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_debris(path)
    token = secrets.token_hex(_TOKEN_BYTES)
    new = _sibling(path, "tmp", token)
    os.mkdir(new)
    if path.is_dir():
        shutil.copymode(path, new)
    try:
        yield new
        for entry in kept:
            if not (new / entry.name).exists():
                shutil.copy2(entry, new / entry.name)
        for root, _, files in os.walk(new):
            for name in files:
                _fsync(Path(root) / name)
        _fsync(new)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    try:
        old = _swap(new, path, token)
    except BaseException:
        if not path.exists() and _sibling(path, "old", token).is_dir():
            os.rename(_sibling(path, "old", token), path)  # undo the first of two renames
        shutil.rmtree(new, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)  # the old contents; a failure leaves debris for next time


def _swap(new: Path, path: Path, token: str) -> Path:
    """Puts the complete directory `new` at `path`; returns where the old contents now are."""
    if not path.exists():
        os.rename(new, path)  # atomic: nothing to replace
        _fsync(path.parent)
        return new  # now `path`'s old name: nothing there
    if _exchange(new, path):
        _fsync(path.parent)
        return new
    old = _sibling(path, "old", token)
    os.rename(path, old)
    _fsync(path.parent)
    os.rename(new, path)
    _fsync(path.parent)
    return old
