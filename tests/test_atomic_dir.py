"""atomic_dir: reads pinned to one version of a directory during swaps; debris is only the saver's own."""

import os
from pathlib import Path

import pytest

from mtp_jax.checkpoints import atomic_dir

TOKEN = "0123456789abcdef"  # the saver's format: secrets.token_hex(8)


def _owned(name: str) -> bool:
    return name in ("a", "b")


def _write(path: Path, text: str) -> None:
    """Replaces `path` with a directory holding files a and b, both reading `text`."""
    with atomic_dir.replace_dir(path, overwrite=True, owned=_owned) as new:
        for name in ("a", "b"):
            (new / name).write_text(text)


def _read_across_a_swap(path: Path, swaps: list[str]):
    """A reader that reads a, lets a save replace `path` (the next text in `swaps`), then reads b."""
    attempts = []

    def read(root: Path) -> tuple[str, str]:
        attempts.append(root)
        a = (root / "a").read_text()
        if swaps:
            _write(path, swaps.pop(0))
        return a, (root / "b").read_text()

    return read, attempts


def test_read_during_a_swap_sees_the_old_version_whole(tmp_path):
    path = tmp_path / "model"
    _write(path, "old")
    fd = os.open(path, os.O_RDONLY)
    try:
        if atomic_dir._pinned_root(fd, os.fstat(fd)) is None:
            pytest.skip("no /proc/self/fd")
    finally:
        os.close(fd)

    # The swap's clean-up deletes the old directory's files; b of the old version is gone, so the
    # read is repeated from `path`, now the new version, and returns it whole.
    read, attempts = _read_across_a_swap(path, ["new"])
    assert atomic_dir.read_dir(path, read) == ("new", "new")
    assert len(attempts) == 2 and all(str(root).startswith("/proc/self/fd/") for root in attempts)

    # A reader that holds b open before the swap reads the old version whole, in one attempt.
    def read_both_first(root: Path) -> tuple[str, str]:
        with open(root / "a") as a, open(root / "b") as b:
            _write(path, "newer")
            return a.read(), b.read()

    assert atomic_dir.read_dir(path, read_both_first) == ("new", "new")
    assert (path / "a").read_text() == "newer"


def test_without_proc_a_read_that_a_swap_interrupted_is_repeated(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_dir, "_pinned_root", lambda fd, pinned: None)
    path = tmp_path / "model"
    _write(path, "old")
    read, attempts = _read_across_a_swap(path, ["new"])  # plain paths: this attempt reads old a, new b
    assert atomic_dir.read_dir(path, read) == ("new", "new")
    assert attempts == [path, path]

    read, attempts = _read_across_a_swap(path, [f"v{i}" for i in range(atomic_dir.READ_ATTEMPTS)])
    with pytest.raises(OSError, match=f"replaced by a concurrent save during each of {atomic_dir.READ_ATTEMPTS}"):
        atomic_dir.read_dir(path, read)
    assert len(attempts) == atomic_dir.READ_ATTEMPTS


def test_a_real_error_is_raised_at_once(tmp_path):
    path = tmp_path / "model"
    _write(path, "old")
    attempts = []

    def read(root: Path) -> str:
        attempts.append(root)
        return (root / "missing").read_text()

    with pytest.raises(FileNotFoundError):
        atomic_dir.read_dir(path, read)
    assert len(attempts) == 1
    assert atomic_dir.read_dir(tmp_path / "absent", lambda root: root) == tmp_path / "absent"  # not opened


def test_only_siblings_in_the_savers_token_format_are_debris(tmp_path):
    path = tmp_path / "model"
    _write(path, "old")
    theirs = [
        ".model.tmp-abc",
        ".model.old-abc",
        f".model.tmp-{TOKEN}0",
        f".model.tmp-{TOKEN.upper()}",
        f".model.old-{TOKEN[:-1]}",
        f".model.tmp-{TOKEN}.bak",
    ]
    for name in theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "precious").write_text(name)
    for kind in ("tmp", "old"):
        (tmp_path / f".model.{kind}-{TOKEN}").mkdir()  # a killed save's leftovers
    _write(path, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*theirs, "model"])
    assert all((tmp_path / name / "precious").read_text() == name for name in theirs)


def test_recover_ignores_a_pair_not_in_the_token_format(tmp_path):
    for kind in ("tmp", "old"):
        (tmp_path / f".model.{kind}-ab").mkdir()
    assert atomic_dir.recover(tmp_path / "model") is False
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.old-ab", ".model.tmp-ab"]
    (tmp_path / f".model.old-{TOKEN}").mkdir()
    (tmp_path / f".model.tmp-{TOKEN}").mkdir()
    assert atomic_dir.recover(tmp_path / "model") is True
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.old-ab", ".model.tmp-ab", "model"]
