"""Fixtures for the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model, built once per session into a private cache folder (never the user's)."""
    import torch

    from kvbank.engine.model.builtin import builtin_model_dir as build

    # One intra-op thread: this model is tiny, and on a shared 2-core box OpenMP threads that
    # spin against other processes make a step 100x slower.
    torch.set_num_threads(1)
    return build(tmp_path_factory.mktemp("kvbank-cache"))
