"""Shared fixtures: tiny random-weight SD3 folders built offline, one engine per folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_sd3  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory) -> Path:
    """A tiny SD3 folder without T5 (CLIP x2), 64x64 default, resolution factor 16."""
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"))


@pytest.fixture(scope="session")
def tiny_sd3_t5_dir(tmp_path_factory) -> Path:
    """A tiny SD3 folder with a T5 encoder and a short CLIP limit (16 tokens)."""
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_t5"), with_t5=True, clip_max_length=16)


@pytest.fixture(scope="session")
def sync_engine(tiny_sd3_dir, engine):
    """The shared engine's runner behind an engine without the encode/decode side thread
    (``overlap_stages=False``): every step() prepares, steps and decodes inline, so tests can
    assert exact interleavings."""
    from diffserve import DiffusionEngine, EngineConfig

    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_batch_size=16, overlap_stages=False),
                          runner=engine.runner)
    yield eng
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="session")
def engine(tiny_sd3_dir):
    """A step-mode engine on the tiny SD3 folder (shared: tests must leave it idle)."""
    from diffserve import DiffusionEngine, EngineConfig

    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_batch_size=16))
    yield eng
    assert not eng.has_unfinished_requests()
