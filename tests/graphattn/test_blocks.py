"""BlockManager against a brute-force model of prefix caching: random admissions, growth,
caching and frees over shared prompts never lose, double-own or leak a block, and every
admission finds exactly the longest cached full-block prefix (with the right contents)."""

import numpy as np
import pytest

from graphattn.blocks import BlockManager, NoFreeBlocksError, chain_hashes

BS = 4


class Reference:
    """Prefix caching by token tuples: named prefixes held or evictable (LRU), plain blocks."""

    def __init__(self, num_blocks):
        self.plain = num_blocks
        self.named = {}  # prefix tuple -> holders
        self.lru = []  # evictable prefixes, least recently freed first
        self.reqs = {}  # req -> list of prefix tuples (None: unnamed)

    def free_count(self):
        return self.plain + len(self.lru)

    def lookup(self, ids):
        n = 0
        while (n + 1) * BS <= len(ids) - 1 and tuple(ids[: (n + 1) * BS]) in self.named:
            n += 1
        return n

    def allocate(self, req, ids, num_tokens):
        hit = self.lookup(ids)
        need = -(-num_tokens // BS) - hit
        prefixes = [tuple(ids[: (i + 1) * BS]) for i in range(hit)]
        if need > self.free_count() - sum(p in self.lru for p in prefixes):
            return None
        for p in prefixes:
            if p in self.lru:
                self.lru.remove(p)
            self.named[p] += 1
        for _ in range(need):
            self._take()
        self.reqs[req] = prefixes + [None] * need
        return hit

    def _take(self):
        if self.plain:
            self.plain -= 1
        else:
            del self.named[self.lru.pop(0)]

    def grow(self, req, num_tokens):
        need = -(-num_tokens // BS) - len(self.reqs[req])
        if need > self.free_count():
            return False
        for _ in range(max(need, 0)):
            self._take()
        self.reqs[req] += [None] * max(need, 0)
        return True

    def cache(self, req, ids):
        blocks = self.reqs[req]
        for i in range(min(len(ids) // BS, len(blocks))):
            p = tuple(ids[: (i + 1) * BS])
            if blocks[i] is None and p not in self.named:
                self.named[p] = 1
                blocks[i] = p
            elif blocks[i] is None:
                blocks[i] = ("dup", p)  # named elsewhere: this block stays unnamed

    def free(self, req):
        for p in self.reqs.pop(req):
            if p is None or p[0] == "dup":
                self.plain += 1
            else:
                self.named[p] -= 1
                if self.named[p] == 0:
                    self.lru.append(p)


def check_invariants(m, live):
    held = [b for r in live for b in m.blocks_of(r)]
    counts = np.bincount(np.array(held, dtype=np.int64), minlength=m.num_blocks)
    np.testing.assert_array_equal(counts, m.ref_count)
    free, evictable = set(m._free), set(m._evictable)
    assert len(free) == len(m._free) and not free & evictable
    assert not (free | evictable) & set(held)
    assert len(free | evictable | set(held)) == m.num_blocks  # nothing leaked
    for r in live:  # a request's blocks are distinct; shared ones are named
        b = m.blocks_of(r)
        assert len(set(b)) == len(b)
    shared = np.flatnonzero(m.ref_count > 1)
    assert all(int(b) in m._hash_of for b in shared)


@pytest.mark.parametrize("seed", range(4))
def test_block_manager_matches_the_brute_force_model(seed):
    rng = np.random.default_rng(seed)
    m, ref = BlockManager(24, BS), Reference(24)
    systems = [list(rng.integers(0, 5, 9)) for _ in range(3)]
    tokens, live, contents = {}, [], {}
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            req = f"r{step}"
            ids = (systems[rng.integers(3)][: rng.integers(1, 10)]
                   + list(rng.integers(0, 5, rng.integers(1, 6))))
            want = ref.allocate(req, ids, len(ids))
            if want is None:
                with pytest.raises(NoFreeBlocksError):
                    m.allocate(req, ids)
            else:
                blocks, computed = m.allocate(req, ids)
                assert computed == want * BS and computed < len(ids)
                for i in range(want):  # a hit is exactly the prompt's blocks
                    assert contents[int(blocks[i])] == tuple(ids[i * BS:(i + 1) * BS])
                tokens[req], live = list(ids), live + [req]
        elif op < 0.6:
            req = live[rng.integers(len(live))]
            tokens[req] += list(rng.integers(0, 5, rng.integers(1, 4)))
            if ref.grow(req, len(tokens[req])):
                m.grow(req, len(tokens[req]))
            else:
                with pytest.raises(NoFreeBlocksError):
                    m.grow(req, len(tokens[req]))
                tokens[req] = tokens[req][: len(m.blocks_of(req)) * BS]
        elif op < 0.8:
            req = live[rng.integers(len(live))]
            ids = tokens[req]
            for i, b in enumerate(m.blocks_of(req)[: len(ids) // BS]):  # "write" the KV
                if m.ref_count[b] == 1:
                    contents[b] = tuple(ids[i * BS:(i + 1) * BS])
            m.cache(req, ids)
            ref.cache(req, ids)
        else:
            req = live.pop(rng.integers(len(live)))
            m.free(req)
            ref.free(req)
        check_invariants(m, live)
        assert m.num_free == ref.free_count()
    assert m.num_hits >= 40  # shared prompts were found


def test_chain_hashes_name_the_whole_prefix():
    a = chain_hashes(np.array([1, 2, 3, 4, 5, 6, 7, 8]), 4)
    b = chain_hashes(np.array([9, 2, 3, 4, 5, 6, 7, 8]), 4)
    assert len(a) == 2 and a[1] != b[1]  # same last block, other parent
    assert chain_hashes(np.array([1, 2, 3]), 4) == []
