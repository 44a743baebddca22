"""A KV-cache block manager with automatic prefix caching, for runners without their own.

A fixed pool of blocks. Every full block of a request is named by a hash chain (the hash of
its parent block's hash and its own token ids), so a block's name says the whole prefix up
to its end. Admission looks the prompt's full blocks up by name: the longest cached prefix
is shared (reference counted) and the rest is allocated fresh. A block whose last holder
finished stays cached until its space is needed: free blocks go first, then cached blocks
nobody holds, least recently freed first.

Use it beside a `GraphRunner` (or a `RequestState`)::

    blocks, computed = manager.allocate(req_id, prompt)
    runner.add_request(req_id, prompt, blocks, num_computed_tokens=computed)
    runner.append_blocks(req_id, manager.grow(req_id, new_length))   # when it grows
    manager.cache(req_id, token_ids)   # its tokens so far: full blocks become hits
    manager.free(req_id); runner.state.remove_request(req_id)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from graphattn.checks import as_index

__all__ = ["BlockManager", "NoFreeBlocksError", "chain_hashes"]


class NoFreeBlocksError(RuntimeError):
    """The pool has too few free or evictable blocks for the request."""


def chain_hashes(token_ids: np.ndarray, block_size: int, parent: bytes = b"") -> list[bytes]:
    """Hash of every full block of `token_ids`, each over its parent's hash and its ids."""
    ids = np.ascontiguousarray(token_ids, dtype=np.int64)
    out, h = [], parent
    for i in range(ids.shape[0] // block_size):
        h = hashlib.blake2b(h + ids[i * block_size:(i + 1) * block_size].tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


class BlockManager:
    """Reference-counted blocks with hash-chained prefix caching and LRU eviction.

    Parameters
    ----------
    num_blocks : int
        Blocks of the pool (the state's ``num_kv_blocks``): ids 0 .. num_blocks - 1.
    block_size : int

    Attributes
    ----------
    ref_count : np.ndarray
        int32 [num_blocks]: live requests holding each block.
    num_hits, num_queried : int
        Prompt tokens found cached, and prompt tokens looked up.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = as_index("num_blocks", num_blocks, 1)
        self.block_size = as_index("block_size", block_size, 1)
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self.num_hits = self.num_queried = 0

    @property
    def num_free(self) -> int:
        """Blocks a request can get now (free, or cached and held by nobody)."""
        return len(self._free) + len(self._evictable)

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self._blocks[req_id])

    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Blocks of the longest cached prefix of full blocks of `token_ids`."""
        found = []
        for h in chain_hashes(np.asarray(token_ids), self.block_size):
            b = self._by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def allocate(self, req_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                 num_tokens: int | None = None) -> tuple[np.ndarray, int]:
        """Blocks for a new request: its longest cached prefix, shared, then fresh ones.

        Parameters
        ----------
        req_id : str
        prompt_token_ids : sequence of int
        num_tokens : int, optional
            Tokens the blocks must hold (default: the prompt's).

        Returns
        -------
        blocks : np.ndarray
            int32 [ceil(num_tokens / block_size)].
        num_computed_tokens : int
            Prompt tokens already in the cache (full blocks; at least one prompt token is
            left to compute, whose logits the first step samples from).

        Raises
        ------
        NoFreeBlocksError
            Too few free or evictable blocks (nothing changed).
        """
        if req_id in self._blocks:
            raise ValueError(f"request {req_id!r} already holds blocks")
        ids = np.asarray(prompt_token_ids)
        n = ids.shape[0] if num_tokens is None else as_index("num_tokens", num_tokens,
                                                              ids.shape[0])
        bs = self.block_size
        hit = self.lookup(ids[: max(ids.shape[0] - 1, 0)])
        need = -(-n // bs) - len(hit)
        evictable_hits = sum(1 for b in hit if b in self._evictable)
        if need > self.num_free - evictable_hits:
            raise NoFreeBlocksError(f"request {req_id!r} needs {need} new blocks, "
                                    f"{self.num_free - evictable_hits} are free")
        for b in hit:
            self._evictable.pop(b, None)
        blocks = hit + [self._take() for _ in range(need)]
        self.ref_count[blocks] += 1
        self._blocks[req_id] = blocks
        self._hashes[req_id] = [self._hash_of[b] for b in hit]
        self.num_hits += len(hit) * bs
        self.num_queried += ids.shape[0]
        return np.array(blocks, dtype=np.int32), len(hit) * bs

    def grow(self, req_id: str, num_tokens: int) -> np.ndarray:
        """New blocks so that the request holds `num_tokens` tokens (none if it does)."""
        blocks = self._blocks[req_id]
        need = -(-as_index("num_tokens", num_tokens, 0) // self.block_size) - len(blocks)
        if need > self.num_free:
            raise NoFreeBlocksError(f"request {req_id!r} needs {need} more blocks, "
                                    f"{self.num_free} are free")
        new = [self._take() for _ in range(max(need, 0))]
        self.ref_count[new] += 1
        blocks += new
        return np.array(new, dtype=np.int32)

    def cache(self, req_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Name the request's full blocks by `token_ids` (its tokens so far, written to the
        KV cache) so that later prompts find them."""
        blocks, hashes = self._blocks[req_id], self._hashes[req_id]
        ids = np.asarray(token_ids)
        full = min(ids.shape[0] // self.block_size, len(blocks))
        if full <= len(hashes):
            return
        start = len(hashes) * self.block_size
        new = chain_hashes(ids[start: full * self.block_size], self.block_size,
                           hashes[-1] if hashes else b"")
        for b, h in zip(blocks[len(hashes): full], new, strict=True):
            if h not in self._by_hash:  # a block of the same name stays the one cached
                self._by_hash[h] = b
                self._hash_of[b] = h
            hashes.append(h)

    def free(self, req_id: str) -> None:
        """Release the request's blocks: those nobody else holds stay cached (if named) or
        return to the free pool."""
        for b in self._blocks.pop(req_id):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        del self._hashes[req_id]

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        b, _ = self._evictable.popitem(last=False)  # least recently freed
        del self._by_hash[self._hash_of.pop(b)]
        return b
