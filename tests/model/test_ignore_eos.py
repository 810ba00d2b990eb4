"""`ignore_eos` through the real engine: a request that asks runs to max_tokens past the model's
end-of-text token; one that does not stops there."""

from __future__ import annotations

from pathlib import Path

import torch

from kvbank.engine.engine import Engine, EngineConfig
from kvbank.engine.model.loader import load_model
from kvbank.engine.model.runner import TorchRunner
from kvbank.engine.request import FinishReason
from kvbank.engine.runner import SamplingParams
from tests.model.test_engine_greedy import MODEL

EOS = 5


def test_ignore_eos_runs_to_max_tokens(builtin_model_dir: Path) -> None:
    model = load_model(builtin_model_dir, torch.device("cpu"))
    runner = TorchRunner(model, num_pages=64, page_size=4, eos_token_id=EOS)
    engine = Engine(EngineConfig(MODEL, 64, debug=True), runner)
    always_eos = ((EOS, 100.0),)  # the model's end-of-text, every step
    engine.add_request("stops", [0, 7, 8], 6, sampling=SamplingParams(logit_bias=always_eos))
    engine.add_request(
        "runs", [0, 7, 8], 6, sampling=SamplingParams(logit_bias=always_eos, ignore_eos=True)
    )
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.rid] = out.finish_reason
    assert tokens == {"stops": [EOS], "runs": [EOS] * 6}
    assert reasons == {"stops": FinishReason.STOP, "runs": FinishReason.LENGTH}
