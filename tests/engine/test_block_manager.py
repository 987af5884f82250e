"""BlockManager: allocation, reference counts, LRU reuse of freed blocks, prefix hits verified by tokens."""
import subprocess
import sys
from pathlib import Path

import pytest

from tritonq.engine.block_manager import BlockManager
from tritonq.engine.sequence import Sequence

BS = 16


def computed(bm: BlockManager, seq: Sequence, upto: int | None = None) -> Sequence:
    """Pretend the model wrote KV for the first `upto` tokens (all by default) and register full blocks."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    bm.mark_computed(seq)
    return seq


def allocated(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens, max_new_tokens=1)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    return seq


def test_engine_modules_do_not_import_torch():
    # tritonq/__init__.py imports torch, so stand in an empty package object for it: this checks
    # the three engine modules themselves.
    root = Path(__file__).resolve().parents[2]
    code = (f"import sys, types; pkg = types.ModuleType('tritonq'); pkg.__path__ = [{str(root / 'tritonq')!r}]; "
            "sys.modules['tritonq'] = pkg; "
            "import tritonq.engine.sequence, tritonq.engine.block_manager, tritonq.engine.scheduler; "
            "assert tritonq.engine.scheduler.__file__.startswith(pkg.__path__[0]); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("block_size", [0, 8, 24, 48, 100])
def test_block_size_must_be_power_of_two_at_least_16(block_size):
    with pytest.raises(ValueError, match=f"block_size is {block_size}"):
        BlockManager(8, block_size)


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks is 0"):
        BlockManager(0, BS)


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 47, 48, 49])
def test_allocate_covers_every_token_and_free_returns_blocks(num_tokens):
    bm = BlockManager(8, BS)
    seq = allocated(bm, 0, list(range(num_tokens)))
    expected = (num_tokens + BS - 1) // BS
    assert len(seq.block_table) == len(set(seq.block_table)) == expected
    assert bm.num_free_blocks == 8 - expected and bm.usage == pytest.approx(expected / 8)
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage == 0 and seq.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_can_allocate_false_when_blocks_run_out_and_allocate_refuses():
    bm = BlockManager(3, BS)
    allocated(bm, 0, list(range(33)))         # 3 blocks
    late = Sequence(1, [7], max_new_tokens=1)
    assert not bm.can_allocate(late)
    with pytest.raises(RuntimeError, match="needs 1 blocks, 0 free"):
        bm.allocate(late)


def test_append_slot_adds_a_block_only_when_the_next_token_needs_one():
    bm = BlockManager(4, BS)
    seq = computed(bm, allocated(bm, 0, list(range(16))))
    seq.append_token(99)                      # token 17 does not fit in one block
    assert len(seq.block_table) == 1 and bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    seq.num_computed_tokens += 1
    seq.append_token(98)                      # token 18 fits in the second block
    bm.append_slot(seq)
    assert len(seq.block_table) == 2


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(10, BS)
    prompt = list(range(100, 140))            # 40 tokens: 2 full blocks + 8
    a = computed(bm, allocated(bm, 0, prompt))
    b = allocated(bm, 1, prompt[:32] + [1, 2, 3])
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == b.num_computed_tokens == 32
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 10 - 4
    assert (bm.prefix_queries, bm.prefix_hits) == (40 + 35, 32)
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 10 and all(x.ref_count == 0 for x in bm.blocks)


def test_last_token_is_never_a_hit():
    # A prompt made exactly of 2 cached full blocks may reuse only the first: the second holds
    # its last token, whose logits must be computed.
    bm = BlockManager(10, BS)
    a = computed(bm, allocated(bm, 0, list(range(40))))
    b = allocated(bm, 1, list(range(32)))
    assert b.num_cached_tokens == 16 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    c = allocated(bm, 2, list(range(33)))
    assert c.num_cached_tokens == 32


def test_only_computed_full_blocks_are_hits():
    bm = BlockManager(10, BS)
    a = computed(bm, allocated(bm, 0, list(range(40))), upto=20)   # a chunk: only block 0 is written
    b = allocated(bm, 1, list(range(40)))
    assert b.num_cached_tokens == 16 and b.block_table[0] == a.block_table[0]


def test_freed_blocks_stay_cached_until_their_memory_is_taken_least_recently_freed_first():
    bm = BlockManager(4, BS)
    prompt = list(range(40))
    a = computed(bm, allocated(bm, 0, prompt))      # blocks 0, 1 registered, 2 partial
    bm.free(a)
    assert list(bm.free_blocks) == [2, 3, 1, 0]
    again = allocated(bm, 1, prompt)                # both full blocks come back from the free list
    assert again.num_cached_tokens == 32 and again.block_table[:2] == a_table(bm, prompt)
    bm.free(again)
    # Free order is: partial block first (nothing to reuse), then the never-used one, then the
    # tail of the prompt, then its head: single-block allocations take them in that order.
    singles = [allocated(bm, 10 + i, [500 + i]) for i in range(3)]
    assert [s.block_table[0] for s in singles] == [2, 3, 1]
    for single in singles:
        bm.free(single)
    head_only = allocated(bm, 20, prompt[:32] + [7])
    assert head_only.num_cached_tokens == 16 and head_only.block_table[0] == 0


def a_table(bm, prompt):
    """The blocks registered for the prompt's first two blocks, found by walking the hash chain."""
    h0 = bm.hash_fn(None, tuple(prompt[:16]))
    h1 = bm.hash_fn(h0, tuple(prompt[16:32]))
    return [bm.hash_to_block[h0], bm.hash_to_block[h1]]


def test_hash_collision_with_different_tokens_is_not_a_hit():
    bm = BlockManager(10, BS, hash_fn=lambda prev, tokens: 0)       # every block collides
    computed(bm, allocated(bm, 0, list(range(40))))
    b = allocated(bm, 1, list(range(1, 41)))
    assert b.num_cached_tokens == b.num_computed_tokens == 0 and bm.prefix_hits == 0
    same = allocated(bm, 2, list(range(20)))
    assert same.num_cached_tokens == 0               # the dict entry for hash 0 is block 1 of seq 0
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)


def test_collision_with_equal_tokens_after_a_different_prefix_is_not_a_hit():
    # The hash ignores the chain, so block "Q" after "P" and block "Q" after "R" share a hash;
    # the stored predecessor tells them apart.
    bm = BlockManager(10, BS, hash_fn=lambda prev, tokens: hash(tokens))
    p, q, r = [1] * 16, [2] * 16, [3] * 16
    a = computed(bm, allocated(bm, 0, p + q + [9]))
    c = computed(bm, allocated(bm, 1, r + q + [9]))
    b = allocated(bm, 2, p + q + [9])
    assert b.block_table[0] == a.block_table[0]
    assert b.num_cached_tokens == 16                 # "Q" is registered under c's chain, not a's
    assert b.block_table[1] not in (a.block_table[1], c.block_table[1])


def test_prefix_caching_disabled_never_hits_or_counts():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    computed(bm, allocated(bm, 0, list(range(40))))
    b = allocated(bm, 1, list(range(40)))
    assert b.num_cached_tokens == 0 and bm.hash_to_block == {} and bm.prefix_queries == 0
