"""logit_bias, presence and frequency penalties and logprobs in the sampler, on crafted logits."""

from __future__ import annotations

import math

import torch

from kvbank.engine.model.sampling import Sampler, probabilities
from kvbank.engine.runner import SamplingParams


def logits(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def test_logit_bias_moves_greedy_to_the_biased_token() -> None:
    sampler = Sampler(torch.device("cpu"))
    row = logits(3.0, 1.0, 0.0, 0.0)
    assert sampler.sample(row, [("a", SamplingParams())]) == [0]
    biased = SamplingParams(logit_bias=((2, 5.0),))
    assert sampler.sample(row, [("a", biased)]) == [2]
    banned = SamplingParams(logit_bias=((0, -100.0),))
    assert sampler.sample(row, [("b", banned)]) == [1]


def test_frequency_penalty_counts_each_use_and_presence_only_the_first() -> None:
    row = logits(2.0, 0.9, 0.0)  # token 0 leads token 1 by 1.1
    # Frequency 0.5: 0 is picked twice (2.0, then 1.5 > 0.9), then 1.0 > 0.9 once more, then
    # 0.5 < 0.9 and 1 takes over.
    freq = Sampler(torch.device("cpu"))
    params = SamplingParams(frequency_penalty=0.5)
    picks = [freq.sample(row, [("r", params)])[0] for _ in range(4)]
    assert picks == [0, 0, 0, 1]
    # Presence 0.5 takes 0.5 once: 1.5 still beats 0.9, whatever the count.
    pres = Sampler(torch.device("cpu"))
    params = SamplingParams(presence_penalty=0.5)
    assert [pres.sample(row, [("r", params)])[0] for _ in range(4)] == [0, 0, 0, 0]
    # Presence 1.5: after one 0, 0.5 < 0.9; after one 1 as well, 0.5 > -0.6.
    pres = Sampler(torch.device("cpu"))
    params = SamplingParams(presence_penalty=1.5)
    assert [pres.sample(row, [("r", params)])[0] for _ in range(3)] == [0, 1, 0]


def test_penalties_are_per_request_and_forgotten_when_it_leaves() -> None:
    sampler = Sampler(torch.device("cpu"))
    row = logits(2.0, 0.9, 0.0)
    params = SamplingParams(presence_penalty=1.5)
    assert sampler.sample(row, [("a", params)]) == [0]
    assert sampler.sample(row, [("b", params)]) == [0]  # b has generated nothing yet
    assert sampler.sample(row, [("a", params)]) == [1]
    sampler.forget("a")
    assert sampler.sample(row, [("a", params)]) == [0]


def test_logprobs_are_the_adjusted_distribution_before_temperature() -> None:
    sampler = Sampler(torch.device("cpu"))
    row = logits(1.0, 2.0, 3.0, 0.0)
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias=((3, 4.0),))
    tokens, found, _ = sampler.sample_with_logprobs(row, [("r", params)])
    assert tokens == [3]
    adjusted = [1.0, 2.0, 3.0, 4.0]
    norm = math.log(sum(math.exp(v) for v in adjusted))
    entry = found["r"]
    assert math.isclose(entry.logprob, 4.0 - norm, rel_tol=1e-5)
    assert [t for t, _ in entry.top] == [3, 2]
    assert math.isclose(entry.top[1][1], 3.0 - norm, rel_tol=1e-5)
    # Rows that ask for none get none, and unadjusted logits are not copied.
    _, none, _ = sampler.sample_with_logprobs(row, [("s", SamplingParams())])
    assert none == {}


def test_a_temperature_or_top_p_below_epsilon_is_greedy() -> None:
    # logits / 1e-39 overflow to inf, and top_p 1e-46 is 0 in float32: both used to leave softmax
    # only NaN, and torch.multinomial raised on the engine thread.
    sampler = Sampler(torch.device("cpu"))
    row = logits(1.0, 3.0, 2.0, 0.0)
    for params in (SamplingParams(temperature=1e-39), SamplingParams(temperature=1.0, top_p=1e-46),
                   SamplingParams(temperature=1e-6, top_k=2, seed=3)):  # fmt: skip
        assert sampler.sample(row, [("r", params)]) == [1]
    assert probabilities(row[0], SamplingParams(temperature=1.0, top_p=1e-46)).tolist() == [
        0.0, 1.0, 0.0, 0.0
    ]  # fmt: skip


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    sampler = Sampler(torch.device("cpu"))
    rows = torch.tensor([[1.0, 3.0, 2.0], [float("-inf")] * 3, [float("nan")] * 3])
    sampled = sampler.sample_with_logprobs(
        rows,
        [("ok", SamplingParams(temperature=1.0, seed=1)), ("inf", SamplingParams()),
         ("nan", SamplingParams(temperature=1.0))],
    )  # fmt: skip
    assert sampled.tokens[0] is not None and sampled.tokens[1:] == [None, None]
    assert set(sampled.failed) == {"inf", "nan"}
    assert "no token is left to sample" in sampled.failed["inf"].message
    assert sampled.failed["inf"].param is None
