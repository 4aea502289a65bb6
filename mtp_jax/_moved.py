"""Module paths of mtp_jax 0.1 that moved when the package was laid out by concern, kept importable
for one release: importing one warns (DeprecationWarning) and gives the module that holds its names now.

`mtp_jax.generate` is not among them: that name is the function `mtp_jax.generate`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old path -> the module that holds its names now, or the modules that share them (a new module then
# carries their public names).
MOVED: dict[str, str | tuple[str, ...]] = {
    "mtp_jax.acceptance": "mtp_jax.decode.acceptance",
    "mtp_jax.atomic_dir": "mtp_jax.checkpoints.atomic_dir",
    "mtp_jax.checkpoint": "mtp_jax.checkpoints",
    "mtp_jax.cli_mesh": "mtp_jax.cli.distributed",
    "mtp_jax.cli_serve": "mtp_jax.cli.serve",
    "mtp_jax.data": "mtp_jax.training.data",
    "mtp_jax.engine": "mtp_jax.decode",
    "mtp_jax.hf_config": "mtp_jax.checkpoints.hf_config",
    "mtp_jax.loss": "mtp_jax.training.loss",
    "mtp_jax.metrics": "mtp_jax.decode.metrics",
    "mtp_jax.pretrained": ("mtp_jax.checkpoints.pretrained", "mtp_jax.decode.text"),  # TextStream went to decode
    "mtp_jax.request": "mtp_jax.decode.request",
    "mtp_jax.rope": "mtp_jax.layers.rope",
    "mtp_jax.run_dir": "mtp_jax.training.run_dir",
    "mtp_jax.sampling": "mtp_jax.decode.sampling",
    "mtp_jax.serving.engine": "mtp_jax.serving.scheduler",
    "mtp_jax.serving.metrics": "mtp_jax.serving.prometheus",
    "mtp_jax.speculative": "mtp_jax.decode",
    "mtp_jax.train": "mtp_jax.training.trainer",
    "mtp_jax.train_step": "mtp_jax.training.step",
}


def _importer_level() -> int:
    """The `stacklevel` (from `_Alias.create_module`) of the code that wrote the import. `warnings` skips
    the import system's internal frames (`importlib._bootstrap`) itself; what is left to pass over are
    importlib's own functions (`importlib.import_module`) between them and the importing line."""
    frame, level = sys._getframe(2), 2
    while frame is not None and "importlib" in frame.f_code.co_filename:
        if "_bootstrap" not in frame.f_code.co_filename:
            level += 1
        frame = frame.f_back
    return level


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in `MOVED` and loads it as the module at the new path."""

    def __init__(self):
        self._specs = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        shown = new if isinstance(new, str) else " and ".join(new)
        warnings.warn(
            f"{spec.name} moved to {shown}; the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=_importer_level(),
        )
        if isinstance(new, tuple):  # a module of its own, with the public names of each
            module = types.ModuleType(spec.name, f"Deprecated: the names of {shown}.")
            for source in map(importlib.import_module, new):
                names = getattr(source, "__all__", [n for n in vars(source) if not n.startswith("_")])
                module.__dict__.update({n: getattr(source, n) for n in names if n not in module.__dict__})
            return module
        module = importlib.import_module(new)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # Already executed under its own name; the import system has just set its __spec__ to the old
        # path's: give it back its own (a module made of several keeps the old path's).
        if module.__name__ in self._specs:
            module.__spec__ = self._specs[module.__name__]


def install() -> None:
    """Adds the finder once (`mtp_jax/__init__.py` calls it)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
