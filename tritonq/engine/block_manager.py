"""KV-cache blocks: allocation, reference counts and prefix caching. Plain Python, no torch.

The cache is `num_blocks` pages of `block_size` token slots; a sequence's `block_table` lists its
pages in order, so position p lives in slot `block_table[p // block_size] * block_size +
p % block_size`.

Prefix caching: once a block is full and its KV written (`mark_computed`), it is registered under
a hash of its token ids chained with the previous block's hash, so equal hashes mean equal
prefixes unless the hash collides. A later sequence whose leading full blocks have the same
hashes shares those pages (reference count + 1) instead of recomputing them. Collisions are
harmless: a hit must also match the block's stored token ids and its predecessor block's id (a
predecessor is never evicted before its successors: whoever holds a block holds the blocks
before it, and frees them after it).

A freed block keeps its hash and stays findable until its memory is taken again. The free list
hands out the least recently freed block first, and a sequence frees its blocks last-to-first,
so the head of a shared prompt is evicted last; blocks holding no registered KV go to the
front of the list (they are worth nothing).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from tritonq.engine.sequence import Sequence


def chained_hash(prev_hash: Hashable | None, tokens: tuple[int, ...]) -> Hashable:
    """Default block hash: Python's tuple hash of the chain and the tokens. Ints hash the same in
    every process (no PYTHONHASHSEED salt, unlike str; None's hash is an address before 3.12), so
    tensor-parallel ranks running their own schedulers agree."""
    return hash((-1 if prev_hash is None else prev_hash, tokens))


class Block:
    """One KV page. `hash`/`token_ids`/`parent` are set while it holds registered (full, computed) KV."""
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Hashable | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: int | None = None   # id of the block before it in the sequence


class BlockManager:
    """Fixed-size KV blocks with a free list, reference counts and (optionally) prefix caching.

    block_size must be a power of two >= 16 (the attention kernels tile pages by it).
    hash_fn(prev_hash, tokens) -> hashable replaces the default `chained_hash` (tests force
    collisions with it). prefix_queries / prefix_hits count prompt tokens looked up / served.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[Hashable | None, tuple[int, ...]], Hashable] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks is {num_blocks}, expected >= 1: give the KV cache more memory.")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size is {block_size}, expected a power of two >= 16 (16, 32, 64, ...).")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn or chained_hash
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block: dict[Hashable, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would find enough blocks (prefix hits on in-use blocks cost none)."""
        hits = self._match_prefix(seq)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(seq.num_tokens) - in_use <= len(self.free_blocks)

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence without blocks pages for all its `num_tokens` tokens.

        Leading full blocks found in the prefix cache are shared; they set `num_cached_tokens`
        and `num_computed_tokens`. Only blocks entirely within `token_ids[:num_tokens - 1]` can
        hit, so at least the last token is computed (its logits give the next token) and a
        shared block is never written. Raises RuntimeError if `can_allocate(seq)` is False.
        """
        if seq.block_table:
            raise RuntimeError(f"allocate: {seq} already holds blocks.")
        if not self.can_allocate(seq):
            raise RuntimeError(f"allocate: {seq} needs {self.blocks_needed(seq.num_tokens)} blocks, "
                               f"{len(self.free_blocks)} free; check can_allocate first.")
        hits = self._match_prefix(seq)
        for block_id in hits:       # take the hits before fresh blocks so none of them gets evicted
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether `append_slot(seq, lookahead)` finds the blocks it needs free."""
        missing = self.blocks_needed(seq.num_tokens + lookahead) - len(seq.block_table)
        return missing <= len(self.free_blocks)

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Add blocks so the table covers every token, the one about to be computed included, and
        `lookahead` slots after them (speculative proposals, see `trim`)."""
        if not self.can_append(seq, lookahead):
            raise RuntimeError(f"append_slot: no free block for {seq} (+{lookahead} lookahead); check can_append first.")
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens + lookahead):
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past what `num_tokens` needs (lookahead slots of rejected proposals). They
        lie past `num_computed_tokens`, so none is registered in the prefix cache: they go to the front
        of the free list."""
        while len(seq.block_table) > self.blocks_needed(seq.num_tokens):
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = None
                self.free_blocks.move_to_end(block.block_id, last=False)

    def mark_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full now that KV up to `num_computed_tokens` is written."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        first = num_full    # walk back to the first full block not registered yet
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            prev = self.blocks[seq.block_table[i - 1]] if i > 0 else None
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block.hash = self.hash_fn(prev.hash if prev else None, block.token_ids)
            block.parent = prev.block_id if prev else None
            self.hash_to_block[block.hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references (last block first); its KV is gone: num_computed_tokens = 0."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:      # nothing reusable in it: hand it out first
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks equal to the sequence's leading full blocks (verified, not just hashed)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        prev: Block | None = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self.hash_to_block.get(self.hash_fn(prev.hash if prev else None, tokens))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != (prev.block_id if prev else None):
                break               # a hash collision: different tokens or a different prefix
            hits.append(block_id)
            prev = block
        return hits

    def _take_free_block(self) -> int:
        """Pop the least recently freed block and forget whatever KV it held."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash = block.token_ids = block.parent = None
        block.ref_count = 1
        return block_id
