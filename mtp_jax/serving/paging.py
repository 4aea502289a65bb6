"""The serving engine's KV pages on the host: who holds which page, the block table each call binds, how wide
it is, and where a prompt's prefill starts after a prefix-cache hit.

`mtp_jax.serving.pages.PageAllocator` lends the pages; `RowPages` turns its answers into what the jitted calls
take (`mtp_jax.cache.PagedCache`): a block table int32 [rows, W] whose width W, in pages, is one of a few
compiled `buckets` covering the positions the call touches, so a call reads only the pages its rows need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from mtp_jax.cache import PagedCache, PageLayout, init_cache
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import Transformer
from mtp_jax.serving.pages import PageAllocator
from mtp_jax.serving.requests import ServedRequest
from mtp_jax.validation import is_integer

BUCKET_RATIO = 4  # default block-table widths: 1, 4, 16, ... pages and the widest (a call reads < 4x its need)


def default_buckets(max_pages: int) -> tuple[int, ...]:
    """Powers of `BUCKET_RATIO` below `max_pages`, and `max_pages`."""
    smaller = [BUCKET_RATIO**i for i in range(max_pages.bit_length()) if BUCKET_RATIO**i < max_pages]
    return (*smaller, max_pages)


def page_bytes(model: Transformer, speculative: SpeculativeConfig | None, page_size: int) -> int:
    """Bytes of one KV page of `page_size` positions in every paged layer: the main model's attention layers
    and the MTP modules' caches `speculative` keeps (recurrent states are per row, not paged). Computed from
    abstract shapes: nothing is allocated."""
    layout = PageLayout(1, page_size)
    mtp = 0 if speculative is None else speculative.num_caches

    def caches():
        return init_cache(model.init_cache, 1, page_size, layout), tuple(
            init_cache(model.mtp[j].init_cache, 1, page_size, layout) for j in range(mtp)
        )

    nodes = jax.tree.leaves(jax.eval_shape(caches), is_leaf=lambda x: isinstance(x, PagedCache))
    return sum(x.size * x.dtype.itemsize for n in nodes if isinstance(n, PagedCache) for x in jax.tree.leaves(n.pool))


def pool_pages(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    *,
    max_batch: int,
    page_size: int,
    max_length: int | None = None,
    num_pages: int | None = None,
    kv_cache_memory: int | None = None,
) -> int:
    """The pages of a serving engine's pool: `num_pages`, or as many as `kv_cache_memory` bytes hold
    (`page_bytes` each), or by default `max_batch` x ceil(`max_length` / `page_size`) (the memory of dense
    rows; `max_length` is needed there only). `model` may be abstract. Raises ValueError for a page_size
    that is not an int >= 1, when both num_pages and kv_cache_memory are given, when neither is and
    max_length is None, or when the memory holds no page."""
    if not is_integer(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if num_pages is not None and kv_cache_memory is not None:
        raise ValueError("give num_pages or kv_cache_memory, not both")
    if kv_cache_memory is None:
        if num_pages is None and max_length is None:
            raise ValueError("give num_pages, kv_cache_memory or max_length (the pool of dense rows)")
        return max_batch * -(-max_length // page_size) if num_pages is None else num_pages
    per_page = page_bytes(model, speculative, page_size)
    if kv_cache_memory < per_page:
        raise ValueError(f"--kv-cache-memory {kv_cache_memory} bytes holds no KV page ({per_page} bytes)")
    return kv_cache_memory // per_page


def prefix_caching_default(model: Transformer, speculative: SpeculativeConfig | None, asked: bool | None) -> bool:
    """Whether an engine caches prefixes: `asked`, or by default wherever the model allows it.

    Not with recurrent layers (their state at a page boundary is not kept) nor method "vanilla" (its window
    of earlier hidden states is not kept with the pages). Raises ValueError if asked for there."""
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"prefix_caching must be None, True or False, got {asked!r}")
    why = None
    if model.config.is_hybrid:
        why = "the model has recurrent layers, whose states at page boundaries are not kept"
    elif speculative is not None and speculative.method == "vanilla":
        why = "method 'vanilla' drafts from a window of earlier hidden states, which the pages do not keep"
    if asked and why:
        raise ValueError(f"prefix_caching=True is not supported: {why}")
    return bool(why is None if asked is None else asked)


class RowPages:
    """The pages of a `ServingEngine`'s requests.

    Args:
      allocator: the pool's allocator (its `prefix_caching` says whether prefixes are cached).
      max_length: S, most tokens of one request. num_speculative_tokens: K. prefill_chunk: C.
      buckets: the block-table widths calls compile for (pages, increasing; the last covers S), default
        `default_buckets`. ValueError for widths that are not increasing ints >= 1 ending at ceil(S / P).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        max_length: int,
        num_speculative_tokens: int,
        prefill_chunk: int,
        buckets: Sequence[int] | None = None,
    ):
        self.allocator, self.max_length = allocator, max_length
        self.num_speculative_tokens, self.prefill_chunk = num_speculative_tokens, prefill_chunk
        self.page_size = allocator.page_size
        self.max_pages = -(-max_length // self.page_size)  # the widest block table a row needs
        if buckets is not None and not isinstance(buckets, Sequence):
            raise ValueError(f"page_buckets must be a sequence of widths in pages, got {buckets!r}")
        buckets = default_buckets(self.max_pages) if buckets is None else tuple(buckets)
        if (
            not buckets
            or not all(is_integer(w) and w >= 1 for w in buckets)
            or list(buckets) != sorted(set(buckets))
            or buckets[-1] != self.max_pages
        ):
            raise ValueError(
                f"page_buckets must be increasing ints >= 1 ending at ceil(max_length / page_size) = "
                f"{self.max_pages}, got {buckets!r}"
            )
        self.buckets = tuple(int(w) for w in buckets)

    def reach(self, length: int) -> int:
        """Positions a row of `length` committed tokens may write in a step: L + K + 1, within max_length."""
        return min(length + self.num_speculative_tokens + 1, self.max_length)

    def width(self, positions: int) -> int:
        """The narrowest bucket that covers `positions` positions."""
        need = min(self.allocator.pages_for(positions), self.max_pages)
        return next(w for w in self.buckets if w >= need)

    def prefill_width(self, start: int) -> int:
        """The bucket a prefill chunk at `start` needs: its C positions and the K drafts after them."""
        return self.width(start + self.prefill_chunk + self.num_speculative_tokens + 1)

    def table(self, owners: Sequence[ServedRequest | None], width: int) -> np.ndarray:
        """int32 [len(owners), width]: each request's first `width` pages, then the sentinel (a row
        without a request: sentinels only, so the call writes nothing and reads zeros there)."""
        table = np.full((len(owners), width), self.allocator.sentinel, np.int32)
        for row, r in enumerate(owners):
            if r is not None:
                pages = self.allocator.pages(r.id)[:width]
                table[row, : len(pages)] = pages
        return table

    def cached_prefix(self, prompt: list[int]) -> int:
        """Where `prompt`'s prefill starts: the cached pages matched less the last one (whose MTP entry was
        computed from the next token of the request that wrote it), rounded down to a multiple of
        lcm(page_size, prefill_chunk), so every later chunk is computed exactly as without the cache.
        Counts nothing (`admitted` does)."""
        if not self.allocator.prefix_caching:
            return 0
        matched = self.allocator.match(prompt, count=False) - self.page_size
        step = math.lcm(self.page_size, self.prefill_chunk)
        return max(0, matched // step * step)

    def admitted(self, prompt: list[int], start: int) -> None:
        """Counts an admitted prompt as vLLM's prefix-cache queries (its tokens) and hits (those reused)."""
        if self.allocator.prefix_caching:
            self.allocator.queries += len(prompt)
            self.allocator.hits += start

    def offer(self, r: ServedRequest) -> None:
        """Offers `r`'s pages whose every position holds committed KV (0 .. L - 2) to the prefix cache;
        pages that may hold a rejected draft's KV are never offered."""
        final = r.length - 1
        if self.allocator.prefix_caching and final // self.page_size > r.pages_final // self.page_size:
            self.allocator.commit(r.id, r.prompt + r.token_ids, final)
            r.pages_final = final
