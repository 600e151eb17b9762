"""The tiny family folders reload with their diffusers pipeline class, in the layout the adapters
rely on (guidance embedding, scheduler class and state, expert switch, resolution rules); the
builders are seeded and small.

Each test reloads a session folder (``tests/conftest.py``) with ``from_pretrained``. The diffusers
pipeline of every registry folder generates in ``tests/conformance/test_parity.py`` (the reference
of each parity check); here it runs only where the test counts its denoiser calls, or for the
scheduler variants the registry does not hold.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    FluxKontextPipeline,
    FluxPipeline,
    QwenImageEditPipeline,
    QwenImagePipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    WanPipeline,
)

from tiny_models import build_tiny_sd15, load_qwen2vl_processor
from tiny_models.registry import MODELS
from tiny_models.stable_diffusion import SCHEDULERS

MAX_FOLDER_BYTES = 5 * 1024 * 1024


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def _load(cls, folder: Path):
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _check_image(images: np.ndarray, shape: tuple[int, ...]) -> None:
    assert images.shape == shape
    assert images.dtype == np.float32
    assert np.isfinite(images).all() and images.min() >= 0.0 and images.max() <= 1.0


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_flux_schnell(tiny_flux_dir):
    pipe = _load(FluxPipeline, tiny_flux_dir)
    assert not pipe.transformer.config.guidance_embeds
    assert not pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 1.0
    assert pipe.vae_scale_factor == 8


def test_flux_dev(tiny_flux_dev_dir):
    pipe = _load(FluxPipeline, tiny_flux_dev_dir)
    assert pipe.transformer.config.guidance_embeds
    assert pipe.scheduler.config.use_dynamic_shifting


def test_flux_kontext(tiny_flux_kontext_dir):
    pipe = _load(FluxKontextPipeline, tiny_flux_kontext_dir)
    assert pipe.transformer.config.guidance_embeds and pipe.scheduler.config.use_dynamic_shifting


def test_sd15_pndm_default(tiny_sd15_dir):
    pipe = _load(StableDiffusionPipeline, tiny_sd15_dir)
    assert type(pipe.scheduler).__name__ == "PNDMScheduler"
    assert pipe.scheduler.config.skip_prk_steps and pipe.scheduler.config.steps_offset == 1
    unet_calls = _count_calls(pipe.unet)
    out = pipe("a red cat", num_inference_steps=2, generator=_generator(), output_type="np")  # default size
    _check_image(out.images, (1, 64, 64, 3))
    assert len(unet_calls) == 3  # PLMS: N steps run the UNet N + 1 times (module docstring)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_sd15_schedulers(tmp_path, scheduler, prediction_type):
    folder = build_tiny_sd15(tmp_path / "sd15", scheduler=scheduler, prediction_type=prediction_type)
    pipe = _load(StableDiffusionPipeline, folder)
    assert type(pipe.scheduler).__name__ == scheduler
    assert pipe.scheduler.config.prediction_type == prediction_type
    out = pipe("a red cat", negative_prompt="blurry", height=48, width=40, num_inference_steps=2,
               generator=_generator(), output_type="np")
    _check_image(out.images, (1, 48, 40, 3))


def test_sd15_rejects_unknown_scheduler(tmp_path):
    with pytest.raises(ValueError, match="scheduler must be one of"):
        build_tiny_sd15(tmp_path, scheduler="LMSDiscreteScheduler")


def test_sdxl(tiny_sdxl_dir):
    pipe = _load(StableDiffusionXLPipeline, tiny_sdxl_dir)
    assert pipe.unet.config.addition_embed_type == "text_time"
    assert pipe.scheduler.config.timestep_spacing == "leading" and pipe.scheduler.config.steps_offset == 1
    assert pipe.config.force_zeros_for_empty_prompt
    assert pipe.default_sample_size * pipe.vae_scale_factor == 64


def test_qwen_image(tiny_qwen_image_dir):
    pipe = _load(QwenImagePipeline, tiny_qwen_image_dir)
    assert pipe.vae_scale_factor == 8
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift_terminal == 0.02


def test_qwen_image_edit(tiny_qwen_image_edit_dir):
    folder = tiny_qwen_image_edit_dir
    pipe = QwenImageEditPipeline.from_pretrained(folder, processor=load_qwen2vl_processor(folder / "processor"))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.processor.image_processor.merge_size == 2
    with pytest.raises(ValueError, match="videos"):
        pipe.processor(text=["a"], videos=[np.zeros((2, 28, 28, 3), dtype=np.uint8)])


def test_wan21(tiny_wan_dir):
    pipe = _load(WanPipeline, tiny_wan_dir)
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)


def test_wan22_switches_expert_at_boundary(tiny_wan22_dir):
    pipe = _load(WanPipeline, tiny_wan22_dir)
    assert pipe.config.boundary_ratio == 0.875
    high_noise, low_noise = _count_calls(pipe.transformer), _count_calls(pipe.transformer_2)
    out = pipe("a red cat", height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=4.0,
               guidance_scale_2=3.0, generator=_generator())
    _check_image(out.frames, (1, 5, 64, 64, 3))
    assert pipe.scheduler.timesteps.tolist() == [999, 750]
    assert (len(high_noise), len(low_noise)) == (2, 2)  # one step each, cond + uncond


#: The registry's built folders (tests/tiny_models/registry.py), by model id.
BUILT = {model.id: model for model in MODELS if model.build is not None}


@pytest.mark.parametrize("model_id", sorted(BUILT))
def test_builders_are_small_and_seeded(tiny_folder, tmp_path, model_id):
    """A second build with the same seed writes byte-identical files; folders stay a few MB."""
    folder = tiny_folder(model_id)
    files = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    assert sum((folder / f).stat().st_size for f in files) < MAX_FOLDER_BYTES
    again = BUILT[model_id].build(tmp_path / "again")
    assert sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file()) == files
    for f in files:
        assert (again / f).read_bytes() == (folder / f).read_bytes(), f


# --- Weightless benchmark folders (benchmarks/*_config_folder.py) -------------------------------

import flux_config_folder  # noqa: E402  (benchmarks/, on sys.path by tests/conftest.py)
import sdxl_config_folder  # noqa: E402
import wan_config_folder  # noqa: E402

#: Parameters per component of the real checkpoints (FLUX.1-dev, SDXL base 1.0, Wan2.1-T2V-1.3B),
#: and each tokenizer's length.
CONFIG_FOLDERS = {
    "flux": (flux_config_folder, FluxPipeline, {
        "transformer": 11_901_408_320, "text_encoder_2": 4_762_310_656, "text_encoder": 123_060_480,
        "vae": 83_819_683, "tokenizer": 49408, "tokenizer_2": 32100}),
    "sdxl": (sdxl_config_folder, StableDiffusionXLPipeline, {
        "unet": 2_567_463_684, "text_encoder_2": 694_659_840, "text_encoder": 123_060_480, "vae": 83_653_863,
        "tokenizer": 49408, "tokenizer_2": 49408}),
    "wan": (wan_config_folder, WanPipeline, {
        "transformer": 1_418_996_800, "text_encoder": 5_680_910_336, "vae": 126_892_531, "tokenizer": 256300}),
}


def _load_on_meta(folder: Path) -> dict:
    """Every component of ``model_index.json``: models from their configs on the meta device (no
    memory), tokenizers and schedulers with ``from_pretrained``, as ``--load-format dummy`` does."""
    import diffusers
    import transformers

    components = {}
    for name, entry in json.loads((folder / "model_index.json").read_text()).items():
        if not isinstance(entry, list) or entry[0] is None:
            continue
        cls = getattr(importlib.import_module(entry[0]), entry[1])
        if issubclass(cls, diffusers.ModelMixin):
            with torch.device("meta"):
                components[name] = cls.from_config(cls.load_config(folder / name))
        elif issubclass(cls, transformers.PreTrainedModel):
            with torch.device("meta"):
                components[name] = cls(transformers.AutoConfig.from_pretrained(folder / name))
        else:
            components[name] = cls.from_pretrained(folder / name)
    return components


@pytest.mark.parametrize("family", sorted(CONFIG_FOLDERS))
def test_config_folder_has_real_architecture(tmp_path, family):
    module, pipeline_class, expected = CONFIG_FOLDERS[family]
    folder = module.write_folder(tmp_path / family)
    assert not any(p.suffix in (".safetensors", ".bin") for p in folder.rglob("*"))
    components = _load_on_meta(folder)
    sizes = {name: len(obj) if name.startswith("tokenizer") else sum(p.numel() for p in obj.parameters())
             for name, obj in components.items() if name in expected}
    assert sizes == expected
    for name, obj in components.items():
        if name.startswith("tokenizer"):  # every id the tokenizer makes has an embedding row
            encoder = components[name.replace("tokenizer", "text_encoder")]
            assert max(obj("A photo of a cat, 4k!").input_ids) < encoder.config.vocab_size
    pipe = pipeline_class(**components)  # the components fit the pipeline class together
    assert pipe.vae_scale_factor_spatial == 8 if family == "wan" else pipe.vae_scale_factor == 8
