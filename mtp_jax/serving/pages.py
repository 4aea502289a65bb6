"""Host-side KV page allocator with prefix caching: which pages of the paged KV cache each request holds.

The paged cache keeps, per layer, a pool of `num_pages` pages of `page_size` tokens. A running request
(an *owner*, a str id) holds a list of page ids, its block-table row: its logical position s lives in
slot `s % page_size` of page `pages[s // page_size]`. This module is only the bookkeeping (no device
code): who holds which page, which pages hold a reusable prefix, which page is taken next. It follows
vLLM v1's KV cache manager (`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`, `kv_cache_utils.py`):
ref-counted pages, chained page hashes, cached pages kept after release and evicted least recently
released first; the code is our own.

Every page is in exactly one of three states (`PageAllocator.check`):

- **free**: nobody references it and it has no hash. `reserve` takes these first.
- **evictable**: nobody references it, but it is hashed: its KV is a cached prefix `match` finds and
  `adopt` takes back. `reserve` takes these after the free ones, least recently released first, and
  drops the hash (`evictions`).
- **referenced**: listed by one owner or more; its ref count is the number of owners listing it. A page
  two owners list is hashed, and a hashed page is immutable: nobody writes into it again.

Drafts vs committed tokens (seed serving guide, section 8): a speculative step writes draft KV past the
committed tokens, and a rejected draft's entry stays in its page until a later step overwrites it. A
cache key must describe committed KV only, so `commit` hashes a page only once every position in it is
final (below `num_final`); a page holding any draft KV is never hashed. Final positions are never
written again (the engine writes from `num_final` on), which is what makes a hashed page immutable.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from mtp_jax.validation import check_int

_ROOT = bytes(32)  # the parent key of page 0


class PageAllocator:
    """Pages of a paged KV cache, handed to owners (requests), with an LRU cache of hashed prefix pages.

    A page's key chains its tokens to every token before it: key_i = sha256(salt, key_{i-1}, tokens of
    page i), with key_{-1} = 32 zero bytes, the salt length-prefixed and tokens as little-endian int64.
    Two pages share a key only when the whole prefix up to their end (and the salt) is the same, and
    keys are stable across processes (no Python `hash`).

    Args:
        num_pages: pages in the pool (per layer; every layer uses the same page ids).
        page_size: tokens per page.
        prefix_caching: keep released hashed pages for reuse. Off, nothing is ever hashed: `match`
            returns 0 and counts nothing (`queries` and `hits` stay 0, as vLLM records no prefix-cache
            stats then), `adopt` takes 0 tokens only, and a released page is free at once.
        salt: mixed into every key: whatever changes a page's KV for the same tokens (the engine
            passes model identity and dtype). A str is UTF-8 encoded.

    Raises:
        ValueError: `num_pages` or `page_size` not an int >= 1, or `salt` neither bytes nor str.

    Attributes:
        queries: tokens looked up by `match` (vLLM's prefix-cache queries).
        hits: tokens `match` found cached (vLLM's prefix-cache hits).
        evictions: cached pages dropped to make room.
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True, salt: bytes | str = b""):
        self.num_pages = check_int("num_pages", num_pages, 1)
        self.page_size = check_int("page_size", page_size, 1)
        if isinstance(salt, str):
            salt = salt.encode()
        if not isinstance(salt, bytes):
            raise ValueError(f"salt must be bytes or str, got {type(salt).__name__}")
        self.prefix_caching = bool(prefix_caching)
        self._hasher = hashlib.sha256(len(salt).to_bytes(8, "little") + salt)
        self._free = collections.deque(range(self.num_pages))  # unreferenced, unhashed
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._refs = [0] * self.num_pages
        self._owned: dict[str, list[int]] = {}
        self._chain: dict[str, list[bytes]] = {}  # keys of each owner's leading pages, hashed or not
        self._page_key: dict[int, bytes] = {}
        self._key_page: dict[bytes, int] = {}
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    @property
    def sentinel(self) -> int:
        """The page id unused block-table entries hold: `num_pages`, one past the last page (never -1)."""
        return self.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages `reserve` can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one owner."""
        return self.num_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        """Used pages / `num_pages`, in [0, 1]: vLLM's `kv_cache_usage_perc` (unreferenced cached pages are free)."""
        return self.num_used_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """ceil(num_tokens / page_size). Raises ValueError unless `num_tokens` is an int >= 0."""
        return -(-check_int("num_tokens", num_tokens, 0) // self.page_size)

    def holds(self, owner: str) -> bool:
        """Whether `owner` holds pages (was reserved or adopted and not released)."""
        return owner in self._owned

    def pages(self, owner: str) -> list[int]:
        """A copy of `owner`'s page ids, in position order. Raises KeyError for an unknown owner."""
        return list(self._pages_of(owner))

    def block_table(self, owners: Sequence[str | None], width: int) -> np.ndarray:
        """The block table of `owners`: int32 of shape [len(owners), width], row r is owners[r]'s page ids
        then `sentinel`; a None owner is a row of sentinels.

        Raises:
            ValueError: `width` not an int >= 0, or an owner holds more than `width` pages.
            KeyError: an unknown owner.
        """
        check_int("width", width, 0)
        table = np.full((len(owners), width), self.sentinel, np.int32)  # [B, width]
        for row, owner in enumerate(owners):
            if owner is None:
                continue
            pages = self._pages_of(owner)
            if len(pages) > width:
                raise ValueError(f"owner {owner!r} holds {len(pages)} pages, more than width={width}")
            table[row, : len(pages)] = pages
        return table

    def reserve(self, owner: str, num_tokens: int) -> bool:
        """Make `owner` (created if new) hold at least `pages_for(num_tokens)` pages; never shrinks.

        All or nothing: False, with nothing changed (a new owner is not created), when fewer pages are
        free. New pages come from the free pages first, then from the evictable ones, least recently
        released first (its hash is dropped, `evictions` += 1). New pages are the owner's alone, so it
        may write them. Raises ValueError unless `num_tokens` is an int >= 0.
        """
        need = self.pages_for(num_tokens) - len(self._owned.get(owner, ()))
        if need > self.num_free_pages:
            return False
        pages = self._owned.setdefault(owner, [])
        self._chain.setdefault(owner, [])
        for _ in range(need):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._key_page[self._page_key.pop(page)]
                self.evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return True

    def release(self, owner: str) -> None:
        """`owner` gives up all its pages and is forgotten (ref count - 1 each).

        A page nobody references any more becomes evictable if hashed (kept for `match`), else free.
        Pages are released last page first, as vLLM does, so a request's tail is evicted before the
        prefix it shares with others. Raises KeyError for an unknown (or already released) owner.
        """
        pages = self._pages_of(owner)
        del self._owned[owner], self._chain[owner]
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._page_key:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def match(self, tokens: Sequence[int], *, count: bool = True) -> int:
        """Tokens of `tokens` covered by cached pages: a multiple of `page_size`, the longest run of full
        pages from the start whose chain keys are cached. Takes nothing; `adopt` does.

        The caller caps `tokens` as it needs: the last prompt token must still be computed for its
        logits, so the engine passes the prompt less its last token (vLLM's `num_tokens - 1`).
        With `count` (and prefix caching on), `queries` += len(tokens) and `hits` += the answer; pass
        False when retrying a request already counted. Raises ValueError unless `tokens` are int ids.
        """
        if not self.prefix_caching:
            return 0
        matched = 0
        for key in self._keys(tokens, 0, _ROOT, len(tokens) // self.page_size):
            if key not in self._key_page:
                break
            matched += self.page_size
        if count:
            self.queries += len(tokens)
            self.hits += matched
        return matched

    def adopt(self, owner: str, tokens: Sequence[int], num_tokens: int) -> None:
        """Make new `owner` hold the cached pages of the first `num_tokens` of `tokens` (ref count + 1
        each; an evictable one is no longer evictable). Then `reserve` the rest.

        The adopted pages are shared and immutable: the caller must never write into them (it computes
        positions from `num_tokens` on). They are already hashed, so `commit` starts after them.

        Raises:
            ValueError: `owner` already exists, or `num_tokens` is not an int multiple of `page_size`
                within `match(tokens)` (with prefix caching off, only 0 is), or `tokens` are not int ids.
        """
        if owner in self._owned:
            raise ValueError(f"owner {owner!r} already holds pages")
        check_int("num_tokens", num_tokens, 0)
        if num_tokens % self.page_size or num_tokens > len(tokens):
            raise ValueError(f"num_tokens={num_tokens} must be a multiple of {self.page_size} <= len(tokens)")
        keys = list(self._keys(tokens, 0, _ROOT, num_tokens // self.page_size))
        pages = [self._key_page.get(key) for key in keys]
        if None in pages:
            raise ValueError(f"the first {num_tokens} tokens are not all cached (match them first)")
        for page in pages:
            self._refs[page] += 1
            self._evictable.pop(page, None)
        self._owned[owner] = pages
        self._chain[owner] = keys

    def commit(self, owner: str, tokens: Sequence[int], num_final: int) -> None:
        """Hash `owner`'s full pages whose KV is final, so later requests can `match` and `adopt` them.

        `tokens` is the owner's whole sequence so far (prompt and committed output; its leading tokens
        never change) and `num_final` the number of leading positions whose KV is final: the engine
        passes L - 1 for L committed tokens (the cache holds positions 0..L-2; later ones may hold
        rejected drafts). Page i is hashed once (i + 1) * page_size <= num_final, in chain order. Every
        page past the owner's chain came from `reserve`, so it is the owner's alone (shared pages came
        from `adopt`, already hashed). A page whose key another page already holds (two requests with
        the same prefix at once) stays unhashed and is freed on release. No-op with prefix caching off.

        Raises:
            KeyError: unknown owner.
            ValueError: `num_final` not an int in [0, len(tokens)], or past the owner's pages.
        """
        pages = self._pages_of(owner)
        if check_int("num_final", num_final, 0) > len(tokens):
            raise ValueError(f"num_final={num_final} exceeds len(tokens)={len(tokens)}")
        if num_final > len(pages) * self.page_size:
            raise ValueError(f"num_final={num_final} exceeds the {len(pages)} pages owner {owner!r} holds")
        if not self.prefix_caching:
            return
        chain = self._chain[owner]
        parent = chain[-1] if chain else _ROOT
        for i, key in enumerate(self._keys(tokens, len(chain), parent, num_final // self.page_size), len(chain)):
            chain.append(key)
            if key not in self._key_page:
                self._page_key[pages[i]] = key
                self._key_page[key] = pages[i]

    def check(self) -> None:
        """Raise AssertionError, with a message, unless the internal invariants hold: every page is exactly
        one of free / evictable / referenced; each ref count is the number of owners listing the page; no
        owner lists a page twice; pages and keys map 1:1, evictable pages are hashed and free ones not; a
        page two owners list is hashed; an owner's hashed page i has key i of the owner's chain."""
        refs = [0] * self.num_pages
        for owner, pages in self._owned.items():
            _require(len(set(pages)) == len(pages), f"owner {owner!r} lists a page twice: {pages}")
            chain = self._chain[owner]
            _require(len(chain) <= len(pages), f"owner {owner!r} has {len(chain)} keys for {len(pages)} pages")
            for i, page in enumerate(pages):
                refs[page] += 1
                key = self._page_key.get(page)
                _require(key is None or chain[i : i + 1] == [key], f"owner {owner!r}'s page {i} has a wrong key")
        _require(refs == self._refs, f"ref counts {self._refs} != owners' listings {refs}")
        free, evictable = set(self._free), set(self._evictable)
        referenced = {page for page, ref in enumerate(refs) if ref}
        _require(len(free) == len(self._free), "a free page is listed twice")
        _require(not (free & evictable or free & referenced or evictable & referenced), "a page has two states")
        _require(len(free) + len(evictable) + len(referenced) == self.num_pages, "a page has no state")
        _require(all(self._key_page.get(key) == page for page, key in self._page_key.items()), "keys not 1:1")
        _require(len(self._key_page) == len(self._page_key), "keys not 1:1")
        _require(evictable <= self._page_key.keys() and not free & self._page_key.keys(), "hash state wrong")
        shared = [page for page, ref in enumerate(refs) if ref > 1 and page not in self._page_key]
        _require(not shared, f"shared pages {shared} are not hashed")

    def _pages_of(self, owner: str) -> list[int]:
        if owner not in self._owned:
            raise KeyError(f"unknown owner {owner!r}")
        return self._owned[owner]

    def _keys(self, tokens: Sequence[int], start: int, parent: bytes, stop: int) -> Iterator[bytes]:
        """Chain keys of pages start..stop-1 of `tokens`, page `start` chained to `parent`."""
        for i in range(start, stop):
            page_tokens = np.asarray(tokens[i * self.page_size : (i + 1) * self.page_size])
            if page_tokens.dtype.kind not in "iu":
                raise ValueError(f"tokens must be int token ids, got dtype {page_tokens.dtype}")
            hasher = self._hasher.copy()
            hasher.update(parent)
            hasher.update(page_tokens.astype("<i8").tobytes())
            parent = hasher.digest()
            yield parent


def _require(condition: bool, message: str) -> None:
    """`assert` that survives `python -O`."""
    if not condition:
        raise AssertionError(message)
