"""Fixtures for the tensor-parallel tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model, built once into a private cache folder and passed as --model."""
    from kvbank.engine.model.builtin import builtin_model_dir as build

    return build(tmp_path_factory.mktemp("kvbank-cache"))
