"""How much output to expect of a best-effort request: what its admission reserves beyond its
prompt. Two estimators, measured against each other in `kvbank bench`:

- `DecayingRatio` (SGLang's `new_token_ratio`): a fraction of what is left of the request's
  output budget, 0.7 at first, falling linearly to a floor of 0.1 over `decay_steps` steps and
  raised back to the start on every preemption. It knows nothing of the traffic: a pool whose
  requests stop early pays for 70% of their budget after every preemption.
- `LearnedLengths`: the output lengths this pool has seen, per class, in a sliding window of the
  last `window` finished requests. A request that has written `n` tokens is expected to reach
  the `quantile` of the lengths above `n` (the distribution conditioned on having got that far),
  capped at its budget. Until a class has `min_samples` lengths, it answers with the whole
  remaining budget: a guess would be a guess, and the strict test is the cautious one.

Both are pure Python and deterministic; the policy owns one and feeds it finishes and steps.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DecayingRatio:
    initial: float = 0.7
    floor: float = 0.1
    decay_steps: int = 600
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.initial <= 1:
            raise ValueError(
                f"the ratio must fall from initial to floor within (0, 1]: got initial "
                f"{self.initial}, floor {self.floor}"
            )
        self.ratio = self.initial

    def expected_output(self, service_class: str, produced: int, budget: int) -> int:
        """Output tokens the request is expected to write in all (at least `produced`)."""
        return min(budget, produced + math.ceil(self.ratio * (budget - produced)))

    def observe(self, service_class: str, output_tokens: int) -> None:
        """A request of the class finished after `output_tokens` tokens (unused here)."""

    def end_step(self) -> None:
        step = (self.initial - self.floor) / self.decay_steps
        self.ratio = max(self.floor, self.ratio - step)

    def on_preemption(self) -> None:
        self.ratio = self.initial


@dataclass
class LearnedLengths:
    quantile: float = 0.9
    window: int = 1000
    min_samples: int = 20
    _recent: dict[str, deque[int]] = field(default_factory=dict, init=False)
    _sorted: dict[str, list[int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.window < self.min_samples or self.min_samples < 1:
            raise ValueError(
                f"window ({self.window}) must hold at least min_samples ({self.min_samples}) "
                f"lengths, and min_samples must be at least 1"
            )

    def samples(self, service_class: str) -> int:
        return len(self._sorted.get(service_class, ()))

    def expected_output(self, service_class: str, produced: int, budget: int) -> int:
        lengths = self._sorted.get(service_class, [])
        longer = len(lengths) - bisect.bisect_right(lengths, produced)
        if len(lengths) < self.min_samples or longer == 0:
            # Too few lengths to learn from, or longer than anything seen: nothing to go by.
            return budget
        rank = len(lengths) - longer + math.ceil(self.quantile * longer) - 1
        return max(produced + 1, min(budget, lengths[rank]))

    def observe(self, service_class: str, output_tokens: int) -> None:
        recent = self._recent.setdefault(service_class, deque())
        ordered = self._sorted.setdefault(service_class, [])
        recent.append(output_tokens)
        bisect.insort(ordered, output_tokens)
        if len(recent) > self.window:
            oldest = recent.popleft()
            del ordered[bisect.bisect_left(ordered, oldest)]

    def end_step(self) -> None:
        """Steps change nothing: what is learned are lengths, not time."""

    def on_preemption(self) -> None:
        """A preemption changes nothing either: the lengths are what they were."""
