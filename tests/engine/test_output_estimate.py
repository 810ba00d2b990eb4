"""The output estimators best-effort admission is built on, with exact numbers."""

from __future__ import annotations

import pytest

from kvbank.engine.admission.estimate import DecayingRatio, LearnedLengths


def test_the_decaying_ratio_falls_to_its_floor_and_jumps_back_on_a_preemption() -> None:
    ratio = DecayingRatio(initial=0.7, floor=0.1, decay_steps=6)
    assert ratio.expected_output("chat", produced=0, budget=100) == 70
    assert ratio.expected_output("chat", produced=40, budget=100) == 40 + 42
    for _ in range(3):
        ratio.end_step()
    assert ratio.ratio == pytest.approx(0.4)
    for _ in range(10):
        ratio.end_step()
    assert ratio.ratio == pytest.approx(0.1)
    assert ratio.expected_output("chat", produced=0, budget=100) == 10
    ratio.on_preemption()
    assert ratio.expected_output("chat", produced=0, budget=100) == 70


def test_learned_lengths_answer_the_whole_budget_until_a_class_has_enough_samples() -> None:
    learned = LearnedLengths(quantile=0.5, window=10, min_samples=4)
    for length in (10, 20, 30):
        learned.observe("chat", length)
    assert learned.expected_output("chat", produced=0, budget=500) == 500
    learned.observe("chat", 40)
    assert learned.expected_output("chat", produced=0, budget=500) == 20  # median of 4
    assert learned.expected_output("voice", produced=0, budget=500) == 500  # another class


def test_learned_lengths_condition_on_the_tokens_already_written() -> None:
    learned = LearnedLengths(quantile=0.5, window=100, min_samples=1)
    for length in range(10, 110, 10):  # 10, 20, ..., 100
        learned.observe("chat", length)
    assert learned.expected_output("chat", produced=0, budget=500) == 50
    assert learned.expected_output("chat", produced=55, budget=500) == 80  # of 60..100
    assert learned.expected_output("chat", produced=55, budget=70) == 70  # capped at budget
    assert learned.expected_output("chat", produced=100, budget=500) == 500  # past them all
    assert learned.expected_output("chat", produced=99, budget=500) == 100


def test_learned_lengths_forget_outside_their_window() -> None:
    learned = LearnedLengths(quantile=1.0, window=3, min_samples=3)
    for length in (500, 5, 6, 7):
        learned.observe("chat", length)
    assert learned.samples("chat") == 3
    assert learned.expected_output("chat", produced=0, budget=1000) == 7


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LearnedLengths(quantile=0), "quantile must be in \\(0, 1\\], got 0"),
        (lambda: LearnedLengths(window=5, min_samples=10), "window \\(5\\) must hold"),
        (lambda: DecayingRatio(initial=0.1, floor=0.5), "initial 0.1, floor 0.5"),
    ],
)
def test_bad_settings_say_what_to_change(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
