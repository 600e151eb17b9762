"""Shared fixtures: tiny random-weight pipeline folders built offline (one per family, built once
per session), and one engine on the tiny SD3 folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
#: benchmarks/ is not a package: tests import its scripts (``quality``, ``quality_video``, ...) as modules.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from tiny_models import (  # noqa: E402
    build_tiny_flux,
    build_tiny_flux_kontext,
    build_tiny_glm_image,
    build_tiny_qwen_image,
    build_tiny_qwen_image_edit,
    build_tiny_sd3,
    build_tiny_sd15,
    build_tiny_sdxl,
    build_tiny_wan,
    build_tiny_wan22,
)

torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread():
    """Run the test with ``torch.set_num_threads(1)`` and restore the previous count afterwards
    (for tests whose code under test sets its own thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory) -> Path:
    """A tiny SD3 folder without T5 (CLIP x2), 64x64 default, resolution factor 16."""
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"))


@pytest.fixture(scope="session")
def tiny_glm_image_dir(tmp_path_factory) -> Path:
    """A tiny GLM-Image folder (AR stage writing 32-code prior tokens + DiT); sizes 32 x k."""
    return build_tiny_glm_image(tmp_path_factory.mktemp("tiny_glm_image"))


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
def tiny_flux_dir(tmp_path_factory) -> Path:
    """A tiny FLUX.1-schnell-like folder (``FluxPipeline``, no guidance embedding, shift 1)."""
    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux"), variant="schnell")


@pytest.fixture(scope="session")
def tiny_flux_dev_dir(tmp_path_factory) -> Path:
    """A tiny FLUX.1-dev-like folder (``FluxPipeline``, guidance embedding, dynamic shifting)."""
    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux_dev"), variant="dev")


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tmp_path_factory) -> Path:
    """A tiny ``FluxKontextPipeline`` folder (Flux-dev components)."""
    return build_tiny_flux_kontext(tmp_path_factory.mktemp("tiny_flux_kontext"))


@pytest.fixture(scope="session")
def tiny_sd15_dir(tmp_path_factory) -> Path:
    """A tiny SD 1.5-layout ``StableDiffusionPipeline`` folder (PNDM, epsilon), 64x64 default."""
    return build_tiny_sd15(tmp_path_factory.mktemp("tiny_sd15"))


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory) -> Path:
    """A tiny SDXL-base-layout ``StableDiffusionXLPipeline`` folder, 64x64 default."""
    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl"))


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory) -> Path:
    """A tiny ``QwenImagePipeline`` folder (Qwen2.5-VL text encoder, Qwen-Image VAE)."""
    return build_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image"))


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_dir(tmp_path_factory) -> Path:
    """A tiny ``QwenImageEditPipeline`` folder; load it with
    ``from_pretrained(dir, processor=tiny_models.load_qwen2vl_processor(dir / "processor"))``."""
    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny_qwen_image_edit"))


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory) -> Path:
    """A tiny Wan 2.1 T2V ``WanPipeline`` folder (4x temporal, 8x spatial VAE)."""
    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan"))


@pytest.fixture(scope="session")
def tiny_wan22_dir(tmp_path_factory) -> Path:
    """A tiny Wan 2.2 two-expert ``WanPipeline`` folder (``transformer_2``, ``boundary_ratio`` 0.875)."""
    return build_tiny_wan22(tmp_path_factory.mktemp("tiny_wan22"))


@pytest.fixture(scope="session")
def engine(tiny_sd3_dir):
    """A step-mode engine on the tiny SD3 folder (shared: tests must leave it idle)."""
    from diffserve import DiffusionEngine, EngineConfig

    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_batch_size=16))
    yield eng
    assert not eng.has_unfinished_requests()
