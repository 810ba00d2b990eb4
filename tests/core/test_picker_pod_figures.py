"""What the picker knows of a pod beyond its headroom: its approximate prefix index (chained
block hashes, and a per-pod record of the most recent blocks routed there), and the room curve
read off the sidecar's figures, used only when it holds together."""

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


def test_a_room_curve_off_the_wire_is_read_only_when_it_holds_together() -> None:
    from kvbank.picker.sidecars import MAX_ROOM_PAIRS, room_from_wire
    from kvbank.proto import admission_pb2 as pb

    def figures(steps: list[int], room: list[int], advance: int = 1) -> pb.RoutingFigures:
        return pb.RoutingFigures(room_steps=steps, room_pages=room, pace_advance=advance,
                                 page_size=16)  # fmt: skip

    curve = room_from_wire(figures([0, 9], [50, 40]))
    assert curve is not None and (curve.steps, curve.room) == ((0, 9), (50, 40))
    assert room_from_wire(pb.RoutingFigures()) is None  # a banker's pod sends none
    for bad in (figures([0, 9], [50]), figures([9, 0], [50, 40]), figures([0], [5], advance=0),
                figures(list(range(MAX_ROOM_PAIRS + 1)), [1] * (MAX_ROOM_PAIRS + 1))):  # fmt: skip
        assert room_from_wire(bad) is None  # the headroom alone is then the test


def test_a_negative_best_effort_backlog_off_the_wire_reads_as_none() -> None:
    """PodFigures refuses a negative backlog; a sidecar's figures are read, not trusted to be
    well formed, so the pod is routed as one with no backlog rather than failing every pick."""
    from kvbank.picker.sidecars import Pod, Watched
    from kvbank.proto import admission_pb2 as pb

    watched = Watched(Pod("10.0.0.5:8000", "10.0.0.5:50051"), live=True)
    watched.figures = pb.RoutingFigures(
        ready=True, usable_pages=100, headroom_pages=40, best_effort_backlog_pages=-5
    )
    figures = watched.pod_figures()
    assert figures is not None and figures.best_effort_backlog_pages == 0
