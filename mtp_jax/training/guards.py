"""The guards of a training run: a step that is not finite stops it before anything is saved, and
SIGINT / SIGTERM stop it after the current step, with a checkpoint."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import sys
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from tqdm.auto import tqdm


class NonFiniteError(FloatingPointError):
    """A step's loss, gradient norm or updated state is not finite; the run stopped before saving it.

    `step` is the step that went wrong; `last_checkpoint` the step of the latest checkpoint (all
    finite), None if there is none.
    """

    def __init__(self, message: str, *, step: int, last_checkpoint: int | None):
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


@jax.jit
def all_finite(tree) -> jax.Array:
    """True (a bool array, on device) when every float in `tree` is finite."""
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def non_finite_error(run_dir: pathlib.Path, manager: ocp.CheckpointManager, step: int, what: str) -> NonFiniteError:
    """The error for a non-finite `what` at `step`, naming the run's latest (finite) checkpoint."""
    last = manager.latest_step()
    where = (
        "no checkpoint was written"
        if last is None
        else f"the last checkpoint, step {last}, is finite and a resume continues from it"
    )
    return NonFiniteError(
        f"{what} not finite at step {step} in {run_dir}: stopped without saving it ({where})",
        step=step,
        last_checkpoint=last,
    )


@contextlib.contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """An event set by SIGTERM or a first SIGINT (a second SIGINT raises KeyboardInterrupt at once)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum, frame):
        if signum == signal.SIGINT and stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        tqdm.write(
            f"{signal.Signals(signum).name}: stopping after this step and saving a checkpoint"
            + (" (Ctrl-C again to abort)" if signum == signal.SIGINT else ""),
            file=sys.stderr,
        )

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
