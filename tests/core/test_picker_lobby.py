"""The picker's lobby: strict requests no pod admits now, held in arrival order until one does."""

import pytest

from kvbank.picker import NoEndpoint, Pick, PodFigures, Refuse, RequestCount
from kvbank.picker.lobby import Lobby


def pod(name: str, headroom: int, usable: int = 100) -> PodFigures:
    return PodFigures(name=name, usable_pages=usable, headroom_pages=headroom)


def strict(pages: int) -> RequestCount:
    return RequestCount(pages=pages)


def test_a_held_request_goes_to_the_first_pod_that_admits_it() -> None:
    lobby = Lobby(max_hold_s=10)
    lobby.enter("r", strict(40), 0.0)
    assert lobby.ask("r", [pod("a", 30), pod("b", 20)], 0.5) is None
    assert lobby.claim("r") == "a"  # it waits for the pod where it starts soonest
    # b frees room first: the request goes there, not to the pod it waited for.
    assert lobby.ask("r", [pod("a", 30), pod("b", 60)], 1.0) == Pick("b")


def test_a_request_behind_may_not_take_the_pod_one_ahead_waits_for() -> None:
    lobby = Lobby(max_hold_s=10)
    lobby.enter("big", strict(80), 0.0)
    lobby.enter("small", strict(20), 0.1)
    pods = [pod("a", 50), pod("b", 30)]
    assert lobby.ask("big", pods, 0.2) is None and lobby.claim("big") == "a"
    # a admits the small one now, but that room is what big waits for; b admits it too.
    assert lobby.ask("small", pods, 0.2) == Pick("b")
    lobby.leave("small")
    lobby.enter("medium", strict(40), 0.3)
    # Only a admits 40 now, and a is claimed: medium waits, and claims b.
    assert lobby.ask("medium", pods, 0.3) is None and lobby.claim("medium") == "b"


def test_the_head_is_not_held_back_by_requests_behind_it() -> None:
    lobby = Lobby(max_hold_s=10)
    lobby.enter("head", strict(40), 0.0)
    lobby.enter("next", strict(40), 0.0)
    assert lobby.ask("next", [pod("a", 10)], 0.1) is None and lobby.claim("next") == "a"
    assert lobby.ask("head", [pod("a", 50)], 0.2) == Pick("a")


def test_past_max_hold_it_goes_where_it_starts_soonest_and_waits_there() -> None:
    lobby = Lobby(max_hold_s=2)
    lobby.enter("r", strict(40), 0.0)
    pods = [pod("a", 30), pod("b", 10)]
    assert lobby.ask("r", pods, 1.9) is None
    assert lobby.ask("r", pods, 2.0) == Pick("a", waits=True)


def test_answers_other_than_a_pick_come_at_once() -> None:
    lobby = Lobby(max_hold_s=10)
    lobby.enter("huge", strict(500), 0.0)
    assert isinstance(lobby.ask("huge", [pod("a", 30)], 0.0), Refuse)
    lobby.enter("r", strict(40), 0.0)
    gone = [PodFigures(name="a", usable_pages=100, headroom_pages=100, ready=False)]
    assert isinstance(lobby.ask("r", gone, 0.0), NoEndpoint)


def test_bad_settings_and_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="max_hold_s must not be negative"):
        Lobby(max_hold_s=-1)
    lobby = Lobby()
    lobby.enter("r", strict(1), 0.0)
    with pytest.raises(ValueError, match="already held"):
        lobby.enter("r", strict(1), 0.0)
    lobby.leave("r")
    lobby.leave("r")  # leaving twice is harmless
    assert len(lobby) == 0
