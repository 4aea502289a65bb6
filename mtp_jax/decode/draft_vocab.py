"""A reduced draft vocabulary (`SpeculativeConfig.draft_vocab`): the MTP passes' head over N chosen tokens.

Each MTP pass ends in the output head shared with the main model, [E, V]: for a large vocabulary that
head is most of the pass (the medium preset: 33M of an eagle pass's 46M weights; Qwen3.5: V = 248k).
FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling"), EAGLE-3's draft vocabulary and SGLang's
`speculative_token_map` draft over the most frequent tokens only. Here `DecodeEngine` gathers those N
columns of the head once (`attached`: a `DraftHead` on the model while the engine splits it, so that the
jitted step receives it with the weights, packed for oneDNN like any Linear), and the drafters call
`draft_head(model, speculative)`: the N logits scattered into a [.., V] row at -inf elsewhere, so that the logits
processing, the argmax or the draft distribution q and the acceptance downstream are unchanged (q is 0
outside the set: rejection sampling stays exact for any q the draft was drawn from).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers.linear import dot_general
from mtp_jax.model import Transformer
from mtp_jax.validation import is_int

ATTRIBUTE = "draft_head"  # where `attached` puts the `DraftHead` on the model


class DraftHead(nnx.Module):
    """The output head restricted to `ids` (int32 [N], sorted): `proj` [E, N] (with the head's bias at
    `ids`, if it has one), in the head's dtypes."""

    def __init__(self, model: Transformer, ids: tuple[int, ...]):
        config, index = model.config, jnp.asarray(ids, jnp.int32)
        head = model.lm_head
        if head is None:  # tied: the embedding rows, transposed
            kernel, bias = model.embed_tokens.embedding[...][index].T, None
        elif type(head) is nnx.Linear and head.kernel[...].ndim == 2:
            kernel = head.kernel[...][:, index]
            bias = None if head.bias is None else head.bias[...][index]
        else:
            raise ValueError(
                f"draft_vocab: the output head is a {type(head).__name__} (an FP8 head?); a draft vocabulary "
                "needs a plain [E, V] head or tied embeddings"
            )
        self.proj = nnx.Linear(
            config.hidden_size,
            len(ids),
            use_bias=bias is not None,
            dtype=config.compute_dtype,
            param_dtype=kernel.dtype,
            dot_general=dot_general,
            kernel_init=nnx.initializers.zeros,
            rngs=nnx.Rngs(0),
        )
        self.proj.kernel.set_value(kernel)
        if bias is not None:
            self.proj.bias.set_value(bias)
        self.ids = nnx.Variable(index)


@contextlib.contextmanager
def attached(model: Transformer, speculative: SpeculativeConfig | None) -> Iterator[None]:
    """Inside it, `model` carries the `DraftHead` of `speculative.draft_vocab` (nothing without one);
    ValueError when the model's head cannot be restricted."""
    if speculative is None or speculative.draft_vocab is None:
        yield
        return
    setattr(model, ATTRIBUTE, DraftHead(model, speculative.draft_vocab))
    try:
        yield
    finally:
        delattr(model, ATTRIBUTE)


def draft_head(model: Transformer, speculative: SpeculativeConfig) -> Callable[[jax.Array], jax.Array]:
    """The head the MTP passes draft with: `model.head`, or over `speculative.draft_vocab` (attached by
    `DecodeEngine`) the logits (float32 [.., V]) of those tokens and -inf for every other. ValueError when
    the config names a set but the model carries none (a step called outside `DecodeEngine`)."""
    restricted = getattr(model, ATTRIBUTE, None)
    if speculative.draft_vocab is None:
        return model.head
    if restricted is None or restricted.proj.out_features != len(speculative.draft_vocab):
        raise ValueError(
            "draft_vocab: the model carries no draft head for this set; build a DecodeEngine (it attaches one) "
            "or call the step inside `mtp_jax.decode.draft_vocab.attached(model, speculative)`"
        )

    def head(x: jax.Array) -> jax.Array:
        logits = restricted.proj(x).astype(jnp.float32)  # [.., N]
        full = jnp.full((*logits.shape[:-1], model.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., restricted.ids[...]].set(logits, indices_are_sorted=True, unique_indices=True)

    return head


def frequent_tokens(tokens, size: int) -> tuple[int, ...]:
    """The `size` most frequent token ids of a corpus, sorted by id: a `SpeculativeConfig.draft_vocab`
    (FR-Spec's frequency ranking). `tokens`: an int array, or sequences of token ids (documents); ties
    go to the lower id, and ids never seen fill up a set larger than the corpus's distinct tokens.
    Raises ValueError for `size` < 1, TypeError for a non-int `size`."""
    if not is_int(size):
        raise TypeError(f"size must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    arrays = [np.asarray(tokens)] if hasattr(tokens, "__array__") else [np.asarray(t) for t in tokens]
    arrays = [a.ravel() for a in arrays if a.size]  # an empty document ([] is a float64 array) counts nothing
    flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    if flat.size and (not np.issubdtype(flat.dtype, np.integer) or flat.min() < 0):
        raise ValueError(f"tokens must be token ids (ints >= 0), got {flat.dtype} values down to {flat.min()}")
    counts = np.bincount(flat.astype(np.int64), minlength=int(size))
    return tuple(sorted(np.argsort(-counts, kind="stable")[: int(size)].tolist()))
