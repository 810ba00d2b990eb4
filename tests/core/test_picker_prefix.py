"""The picker's approximate prefix index: chained block hashes, and a per-pod record that
remembers the most recent blocks routed to it."""

import pytest

from kvbank.picker.prefix import PrefixRecord, prompt_blocks


def test_a_block_hash_stands_for_the_whole_prefix_up_to_it() -> None:
    shared = list(range(100, 132))  # two blocks of 16
    first = prompt_blocks([*shared, *range(1, 40)], 16)
    second = prompt_blocks([*shared, *range(500, 540)], 16)
    assert len(first) == len(second) == 4  # 71 tokens: four full blocks, the rest not counted
    assert first[:2] == second[:2] and first[2] != second[2]
    # The same third block after another prefix is another block.
    moved = prompt_blocks([*range(900, 932), *range(1, 40)], 16)
    assert moved[2] != first[2]
    assert prompt_blocks(list(range(200)), 16, limit=3) == prompt_blocks(list(range(48)), 16)


def test_a_record_matches_leading_blocks_and_forgets_the_oldest() -> None:
    record = PrefixRecord(capacity=4)
    record.record([1, 2, 3])
    assert record.matched([1, 2, 3, 9]) == 3
    assert record.matched([2, 3]) == 2 and record.matched([9, 1]) == 0
    record.record([1, 7, 8])  # 1 is used again: 2 and 3 are now the oldest
    assert len(record) == 4 and set(record.blocks()) == {3, 1, 7, 8}
    assert record.matched([1, 2, 3]) == 1
    with pytest.raises(ValueError, match="at least one block"):
        PrefixRecord(0)
