"""`mtp_jax.serving.pages.PageAllocator`: each method and error by hand, then a 1,000-request serving
simulation (admission with prefix hits, speculative growth, aborts, preemption) that checks the invariants
after every operation and that every adopted page holds exactly the KV its tokens call for."""

import collections

import numpy as np
import pytest

from mtp_jax.serving.pages import PageAllocator


def _held(alloc, owner, tokens, num_final):
    """A new owner holding pages for `tokens`, its first `num_final` positions committed."""
    assert alloc.reserve(owner, len(tokens))
    alloc.commit(owner, tokens, num_final)


@pytest.mark.parametrize("name", ["num_pages", "page_size"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4", None])
def test_init_rejects_bad_sizes(name, value):
    kwargs = {"num_pages": 8, "page_size": 4, name: value}
    with pytest.raises(ValueError, match=name):
        PageAllocator(**kwargs)


def test_init_rejects_bad_salt():
    with pytest.raises(ValueError, match="salt"):
        PageAllocator(8, 4, salt=3)


def test_fresh_allocator():
    alloc = PageAllocator(8, 4)
    assert alloc.sentinel == 8
    assert (alloc.num_free_pages, alloc.num_used_pages, alloc.usage) == (8, 0, 0.0)
    assert (alloc.queries, alloc.hits, alloc.evictions) == (0, 0, 0)
    assert [alloc.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.pages_for(-1)
    alloc.check()


def test_reserve_grows_and_is_all_or_nothing():
    alloc = PageAllocator(4, 4)
    assert alloc.reserve("a", 5)
    assert alloc.pages("a") == [0, 1]
    assert alloc.reserve("a", 3)  # never shrinks
    assert alloc.reserve("a", 8)
    assert alloc.pages("a") == [0, 1]
    assert alloc.reserve("b", 4)
    assert (alloc.num_free_pages, alloc.num_used_pages, alloc.usage) == (1, 3, 0.75)
    assert not alloc.reserve("a", 13)  # needs 2 more, 1 free
    assert alloc.pages("a") == [0, 1] and alloc.num_free_pages == 1
    assert not alloc.reserve("c", 5)
    with pytest.raises(KeyError, match="'c'"):  # a failed reserve creates no owner
        alloc.pages("c")
    assert alloc.reserve("c", 0) and alloc.pages("c") == []
    alloc.check()


def test_pages_is_a_copy_and_unknown_owners_raise():
    alloc = PageAllocator(4, 2)
    alloc.reserve("a", 3)
    alloc.pages("a").append(3)
    assert alloc.pages("a") == [0, 1]
    with pytest.raises(KeyError, match="'nobody'"):
        alloc.pages("nobody")


def test_block_table():
    alloc = PageAllocator(6, 2)
    alloc.reserve("a", 3)
    alloc.reserve("b", 1)
    table = alloc.block_table(["b", None, "a"], 3)
    assert table.dtype == np.int32
    np.testing.assert_array_equal(table, [[2, 6, 6], [6, 6, 6], [0, 1, 6]])
    assert alloc.block_table([], 3).shape == (0, 3)
    with pytest.raises(ValueError, match="width=1"):
        alloc.block_table(["a"], 1)
    with pytest.raises(ValueError, match="width"):
        alloc.block_table(["a"], -1)
    with pytest.raises(KeyError, match="'z'"):
        alloc.block_table(["z"], 3)


def test_release_frees_unhashed_and_keeps_hashed_pages():
    alloc = PageAllocator(4, 2)
    _held(alloc, "a", [1, 2, 3, 4, 5], num_final=4)  # pages 0, 1 final, page 2 not
    alloc.release("a")
    assert (alloc.num_free_pages, alloc.num_used_pages) == (4, 0)
    assert alloc.match([1, 2, 3, 4, 5]) == 4  # pages 0 and 1 stay cached, evictable
    for _ in range(2):
        with pytest.raises(KeyError, match="'a'"):
            alloc.release("a")
    alloc.check()


def test_reserve_takes_free_pages_before_evicting_least_recently_released():
    alloc = PageAllocator(6, 2)
    _held(alloc, "a", [1, 1, 1, 1], 4)  # pages 0, 1
    _held(alloc, "b", [2, 2, 2, 2], 4)  # pages 2, 3
    alloc.release("b")
    alloc.release("a")  # LRU order: 3, 2 (b, tail first), then 1, 0
    assert alloc.reserve("c", 4) and alloc.pages("c") == [4, 5]  # never-cached pages first
    assert alloc.evictions == 0
    assert alloc.reserve("c", 6) and alloc.pages("c")[2:] == [3]
    assert alloc.evictions == 1
    assert alloc.match([2, 2, 2, 2]) == 2  # b's first page is still cached, its second is gone
    assert alloc.reserve("c", 8) and alloc.pages("c")[3:] == [2]
    assert alloc.match([2, 2, 2, 2]) == 0 and alloc.match([1, 1, 1, 1]) == 4
    assert alloc.reserve("c", 10) and alloc.pages("c")[4:] == [1]
    assert alloc.evictions == 3
    alloc.check()


def test_adopt_shares_cached_pages_and_refreshes_them():
    alloc = PageAllocator(6, 2)
    prompt = [5, 6, 7, 8, 9]
    _held(alloc, "a", prompt, 4)
    assert alloc.match(prompt) == 4
    alloc.adopt("b", prompt, 4)  # while a still holds them
    assert alloc.pages("b") == [0, 1] and alloc.num_used_pages == 3
    alloc.check()
    alloc.release("a")
    alloc.release("b")
    _held(alloc, "x", [0, 0], 2)  # page 3, released after a and b's pages
    alloc.release("x")
    alloc.adopt("c", prompt, 2)  # page 0 leaves the evictable list
    assert alloc.pages("c") == [0]
    assert alloc.reserve("d", 8) and alloc.pages("d") == [4, 5, 2, 1]  # free pages first, then the LRU one
    assert alloc.evictions == 1  # page 1, released before x's page 3
    assert alloc.match(prompt) == 2 and alloc.match([0, 0]) == 2
    alloc.check()


def test_adopt_errors():
    alloc = PageAllocator(6, 2)
    prompt = [5, 6, 7, 8, 9]
    _held(alloc, "a", prompt, 4)
    with pytest.raises(ValueError, match="'a' already"):
        alloc.adopt("a", prompt, 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        alloc.adopt("b", prompt, 3)
    with pytest.raises(ValueError, match="not all cached"):
        alloc.adopt("b", prompt + [0], 6)  # pages 0, 1 cached, page 2 not
    with pytest.raises(ValueError, match="not all cached"):
        alloc.adopt("b", [5, 6, 7, 0], 4)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.adopt("b", prompt, -2)
    alloc.adopt("b", [], 0)  # an empty owner: `reserve` the rest
    assert alloc.pages("b") == []
    alloc.check()


def test_match_counts_queries_and_hits():
    alloc = PageAllocator(8, 2)
    _held(alloc, "a", [1, 2, 3, 4, 5, 6], 6)
    assert alloc.match([1, 2, 3, 4, 5]) == 4  # a partial last page never matches
    assert alloc.match([1, 2, 3, 9, 5, 6]) == 2  # the chain stops at the first miss
    assert alloc.match([9, 2, 3, 4, 5, 6]) == 0
    assert alloc.match([1, 2, 3, 4, 5, 6, 7, 8]) == 6
    assert (alloc.queries, alloc.hits) == (5 + 6 + 6 + 8, 4 + 2 + 0 + 6)
    assert alloc.match([1, 2], count=False) == 2
    assert (alloc.queries, alloc.hits) == (25, 12)
    with pytest.raises(ValueError, match="int token ids"):
        alloc.match([1.0, 2.0])


def test_chain_keys_depend_on_every_earlier_page_and_the_salt():
    alloc = PageAllocator(16, 2, salt="model-a bfloat16")
    _held(alloc, "a", [1, 2, 3, 4, 5, 6], 6)
    assert alloc.match([0, 2, 3, 4, 5, 6]) == 0  # same pages 1, 2, different page 0: no page matches
    alloc.adopt("b", [1, 2, 3, 4, 5, 6], 6)
    _held(alloc, "c", [0, 2, 3, 4, 5, 6], 6)  # its own keys: three new pages hashed
    assert alloc.match([0, 2, 3, 4, 5, 6]) == 6
    assert set(alloc.pages("c")).isdisjoint(alloc.pages("a"))
    for salt in (b"model-a bfloat16", "model-a bfloat16"):  # a str salt is its UTF-8 bytes
        same = PageAllocator(16, 2, salt=salt)
        _held(same, "a", [1, 2, 3, 4], 4)
        assert same._page_key == {page: alloc._page_key[page] for page in (0, 1)}
    other = PageAllocator(16, 2, salt="model-a float32")
    _held(other, "a", [1, 2, 3, 4], 4)
    assert set(other._key_page).isdisjoint(alloc._key_page)


def test_commit_hashes_only_final_full_pages():
    alloc = PageAllocator(8, 4)
    tokens = list(range(10, 21))  # 11 committed tokens
    assert alloc.reserve("a", len(tokens) + 3)  # with room for drafts: 4 pages
    for num_final in (0, 3, 7):  # page 0 holds 0..3: final only from num_final = 4
        alloc.commit("a", tokens, num_final)
        assert alloc.match(tokens) == 4 * (num_final // 4)
    alloc.commit("a", tokens, 10)  # positions 8, 9 final, 10 may hold a draft: page 2 stays unhashed
    assert alloc.match(tokens + [0]) == 8
    tokens += [21]
    alloc.commit("a", tokens, 11)
    assert alloc.match(tokens) == 8
    alloc.commit("a", tokens + [22], 12)  # page 2 final now
    assert alloc.match(tokens + [22]) == 12
    alloc.check()


def test_commit_errors_and_no_prefix_caching():
    alloc = PageAllocator(8, 4)
    alloc.reserve("a", 8)
    with pytest.raises(KeyError, match="'b'"):
        alloc.commit("b", [1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="len"):
        alloc.commit("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match="num_final"):
        alloc.commit("a", [1, 2, 3], -1)
    with pytest.raises(ValueError, match="2 pages"):
        alloc.commit("a", list(range(12)), 12)
    off = PageAllocator(4, 2, prefix_caching=False)
    _held(off, "a", [1, 2, 3, 4], 4)
    off.release("a")
    assert off.match([1, 2, 3, 4]) == 0 and (off.queries, off.hits) == (0, 0)
    with pytest.raises(ValueError, match="not all cached"):
        off.adopt("b", [1, 2, 3, 4], 2)
    assert off.reserve("b", 8) and off.evictions == 0  # released pages were free, not cached
    off.check()


def test_same_prefix_at_once_keeps_one_cached_copy():
    alloc = PageAllocator(8, 2)
    _held(alloc, "a", [1, 2, 3, 4], 4)
    _held(alloc, "b", [1, 2, 3, 4, 5, 6], 6)  # pages 0, 1 already cached under a's pages
    alloc.check()
    alloc.release("b")  # b's first two pages were never hashed: free; its third is cached
    assert (len(alloc._free), len(alloc._evictable)) == (5, 1)
    alloc.release("a")
    assert alloc.match([1, 2, 3, 4, 5, 6]) == 6  # a's pages 0, 1, then b's page 2
    alloc.adopt("c", [1, 2, 3, 4, 5, 6], 6)
    assert alloc.pages("c") == [0, 1, 4]
    alloc.check()


def test_check_catches_broken_invariants():
    alloc = PageAllocator(4, 2)
    _held(alloc, "a", [1, 2, 3, 4], 4)
    alloc.adopt("b", [1, 2], 2)
    alloc.check()
    alloc._refs[0] = 1
    with pytest.raises(AssertionError, match="ref counts"):
        alloc.check()
    alloc._refs[0] = 2
    alloc._free.append(0)
    with pytest.raises(AssertionError, match="two states"):
        alloc.check()
    alloc._free.pop()
    del alloc._key_page[alloc._page_key.pop(0)]
    with pytest.raises(AssertionError, match="not hashed"):
        alloc.check()


def test_serving_simulation():
    """1,000 requests through a continuous-batching loop with K drafts per step.

    Page contents are modelled: `kv[page][slot]` is the token whose KV a slot holds, so every adopted page
    must hold exactly the prompt's tokens (a hashed page overwritten with drafts, or a key for KV that is not
    final, shows up as a mismatch)."""
    rng = np.random.default_rng(0)
    page_size, num_pages, K, max_batch = 4, 40, 2, 8
    alloc = PageAllocator(num_pages, page_size, salt="sim")
    kv = [[None] * page_size for _ in range(num_pages)]
    prefixes = [[int(t) for t in rng.integers(0, 50, n)] for n in (8, 13, 20)]  # shared system prompts
    waiting = collections.deque()  # (id, prompt, tokens still to generate)
    running = {}  # id -> [tokens, tokens still to generate], in admission order
    finished = []  # finished requests' tokens
    arrived = preemptions = aborts = 0

    def arrive():
        """A follow-up turn of the last finished conversation (all its tokens, then new ones: its output
        pages hit only if their keys are right), or a system prompt and a question."""
        nonlocal arrived
        follow_up = finished and len(finished[-1]) < 40 and rng.random() < 0.5
        base = finished[-1] if follow_up else prefixes[rng.integers(3)]
        prompt = base + [int(t) for t in rng.integers(0, 50, rng.integers(1, 9))]
        waiting.append((f"r{arrived}", prompt, int(rng.integers(1, 30))))
        arrived += 1

    def write(owner, position, token):
        page = alloc.pages(owner)[position // page_size]
        kv[page][position % page_size] = token

    def grow(owner, num_tokens):
        """reserve, and blank the new pages' slots (a recycled page keeps stale KV; here None)."""
        before = len(alloc.pages(owner))  # the owner exists: adopted, or running
        if not alloc.reserve(owner, num_tokens):
            return False
        for page in alloc.pages(owner)[before:]:
            kv[page] = [None] * page_size
        return True

    def stop(owner):
        alloc.release(owner)
        alloc.check()
        return running.pop(owner)

    while arrived < 1000 or waiting or running:
        while arrived < 1000 and len(waiting) < 4:
            arrive()
        while waiting and len(running) < max_batch:  # admission
            owner, prompt, left = waiting[0]
            matched = alloc.match(prompt[:-1])
            alloc.adopt(owner, prompt, matched)
            for position in range(matched):
                assert kv[alloc.pages(owner)[position // page_size]][position % page_size] == prompt[position]
            if not grow(owner, len(prompt) + K + 1):
                alloc.release(owner)
                alloc.check()
                break
            waiting.popleft()
            for position in range(matched, len(prompt)):  # prefill
                write(owner, position, prompt[position])
            tokens = prompt + [int(rng.integers(0, 50))]
            alloc.commit(owner, tokens, len(tokens) - 1)
            alloc.check()
            running[owner] = [tokens, left - 1]
        for owner in list(running):  # one speculative step
            if owner not in running:
                continue
            tokens, left = running[owner]
            if left <= 0:
                finished.append(stop(owner)[0])
                continue
            if rng.random() < 0.01:
                aborts += 1
                stop(owner)
                continue
            while not grow(owner, len(tokens) + K + 1):  # preempt the newest; it recomputes later
                newest = next(reversed(running))
                waiting.appendleft((newest, *stop(newest)))
                preemptions += 1
                if newest == owner:
                    break
            alloc.check()
            if owner not in running:
                continue
            drafts = [int(d) for d in rng.integers(0, 50, K)]
            write(owner, len(tokens) - 1, tokens[-1])
            for j, draft in enumerate(drafts):
                write(owner, len(tokens) + j, draft)
            accepted = int(rng.integers(0, K + 1))
            bonus = 50 + int(rng.integers(0, 50))  # never equal to a rejected draft
            tokens += drafts[:accepted] + [bonus]
            running[owner][1] -= accepted + 1
            alloc.commit(owner, tokens, len(tokens) - 1)
            alloc.check()

    assert (alloc.num_used_pages, alloc.num_free_pages, alloc.usage) == (0, num_pages, 0.0)
    assert alloc.hits > 0 and alloc.queries > alloc.hits
    assert preemptions > 0 and aborts > 0 and alloc.evictions > 0
