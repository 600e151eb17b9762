"""Pass-through for the whole-request fallback: any ``__call__`` argument of the pipeline class by
name (``SamplingParams.extra``, HTTP ``extra_params``, CLI ``--extra KEY=JSON``), checked against
the signature (unknown names refused by name); an unconditional pipeline (``DDIMPipeline``: no
prompt, no size, no step callback) runs with the prompt refused as unused, never a traceback."""

from __future__ import annotations

import base64
import io
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from diffusers import DDIMPipeline, DDIMScheduler, StableDiffusionPAGPipeline, UNet2DModel
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig, EventType, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main
from diffserve.entrypoints.openai.app import create_app
from diffserve.media.metadata import read_image_metadata
from server_helpers import assert_openai_error, new_engine, serve


@pytest.fixture(scope="module")
def pag_dir(tiny_sd15_dir, tmp_path_factory):
    """The tiny SD 1.5 folder as a ``StableDiffusionPAGPipeline`` (no step adapter: the fallback)."""
    out = tmp_path_factory.mktemp("pag") / "sd15-pag"
    shutil.copytree(tiny_sd15_dir, out)
    index = json.loads((out / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionPAGPipeline"
    (out / "model_index.json").write_text(json.dumps(index))
    return out


@pytest.fixture(scope="module")
def ddim_dir(tmp_path_factory):
    """A tiny unconditional pixel-space ``DDIMPipeline`` (16x16 RGB)."""
    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)
    out = tmp_path_factory.mktemp("ddim") / "ddim"
    DDIMPipeline(unet=unet, scheduler=DDIMScheduler()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pag_engine(pag_dir):
    engine = DiffusionEngine(EngineConfig(model=str(pag_dir), num_threads=1))
    yield engine
    engine.shutdown()


def _pag_reference(folder, **kwargs):
    pipe = StableDiffusionPAGPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red door", num_inference_steps=3, height=64, width=64, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(2), output_type="np", **kwargs).images


def test_pag_scale_passes_through_and_equals_diffusers(pag_engine, pag_dir):
    spec = pag_engine.spec
    assert pag_engine.model_info.step_batching is False
    assert {"pag_scale", "pag_adaptive_scale", "eta", "guidance_rescale"} <= set(spec.extra_parameters)
    assert "prompt" not in spec.extra_parameters and "num_inference_steps" not in spec.extra_parameters
    params = dict(seed=2, num_inference_steps=3, height=64, width=64, guidance_scale=5.0, output_type="np")
    [strong] = pag_engine.generate("a red door", SamplingParams(**params, extra={"pag_scale": 3.0}))
    [none] = pag_engine.generate("a red door", SamplingParams(**params, extra={"pag_scale": 0.0}))
    assert strong.ok and none.ok, (strong.error, none.error)
    np.testing.assert_allclose(strong.images, _pag_reference(pag_dir, pag_scale=3.0), atol=1e-5)
    np.testing.assert_allclose(none.images, _pag_reference(pag_dir, pag_scale=0.0), atol=1e-5)
    assert np.abs(strong.images - none.images).max() > 1e-3  # the argument reached the pipeline
    assert strong.params.extra == {"pag_scale": 3.0}


def test_unknown_extra_names_are_refused_by_name(pag_engine, tiny_sd3_dir):
    with pytest.raises(InvalidRequestError) as info:
        pag_engine.add_request("x", SamplingParams(extra={"pag_scal": 3.0, "pag_scale": 1.0, "prompt": "y"}))
    assert info.value.field == "extra" and info.value.value == ["pag_scal", "prompt"]
    assert "names of StableDiffusionPAGPipeline.__call__ arguments diffserve does not set itself: " in str(info.value)
    with pytest.raises(InvalidRequestError, match="extra.*must be an object"):
        pag_engine.add_request("x", SamplingParams(extra=[("pag_scale", 3.0)]))
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir)))  # step-batched: no extra parameters
    try:
        with pytest.raises(InvalidRequestError, match="StableDiffusion3Pipeline runs with step batching"):
            engine.add_request("x", SamplingParams(extra={"pag_scale": 3.0}))
    finally:
        engine.shutdown()


def test_an_unconditional_pipeline_runs_and_refuses_a_prompt(ddim_dir):
    engine = DiffusionEngine(EngineConfig(model=str(ddim_dir), num_threads=1))
    try:
        spec = engine.spec
        assert not spec.text_conditioned and (spec.default_height, spec.default_width) == (16, 16)
        events = []
        [out] = engine.generate("", SamplingParams(seed=5, num_inference_steps=4, num_images_per_prompt=2,
                                                   output_type="np", extra={"eta": 0.5}), on_event=events.append)
        assert out.ok, out.error
        pipe = DDIMPipeline.from_pretrained(ddim_dir)
        pipe.set_progress_bar_config(disable=True)
        generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]  # image i: seed + i
        reference = pipe(batch_size=2, num_inference_steps=4, eta=0.5, generator=generators, output_type="np").images
        np.testing.assert_allclose(out.images, reference, atol=1e-6)
        assert any(e.type is EventType.PROGRESS for e in events) and events[-1].type is EventType.FINISHED
        for prompt, params, field in (("a cat", SamplingParams(), "prompt"),
                                      ("", SamplingParams(height=32), "height"),
                                      ("", SamplingParams(extra={"prompt": "x"}), "extra")):
            with pytest.raises(InvalidRequestError) as info:
                engine.add_request(prompt, params)
            assert info.value.field == field
        with pytest.raises(InvalidRequestError, match="empty: DDIMPipeline takes no prompt"):
            engine.add_request("a cat", SamplingParams())
    finally:
        engine.shutdown()


def test_cli_extra_and_an_unconditional_model(pag_dir, ddim_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(pag_dir), "a red door", "--steps", "2", "--size", "64x64", "--seed", "1",
                 "--extra", "pag_scale=2.5", "--extra", "guidance_rescale=0.3", "-o", str(tmp_path / "pag")]) == 0
    [png] = (tmp_path / "pag").glob("*.png")
    meta = read_image_metadata(png.read_bytes())
    assert meta["diffserve"]["extra"] == {"pag_scale": 2.5, "guidance_rescale": 0.3}
    assert "pag_scale: 2.5" in meta["parameters"]
    assert main(["generate", "--model", str(ddim_dir), "", "--steps", "2", "-n", "2", "-o", str(tmp_path / "ddim")]) == 0
    assert len(list((tmp_path / "ddim").glob("*.png"))) == 2
    capsys.readouterr()
    for flags, fragment in ((["--extra", "pag_scale"], "argument --extra: invalid value 'pag_scale': must be KEY=JSON"),
                            (["--extra", "pag_scale=abc"], "argument --extra: invalid value 'pag_scale=abc'"),
                            (["--extra", "pag_scal=1"], "argument --extra: invalid value ['pag_scal']")):
        assert main(["generate", "--model", str(pag_dir), "x", "-o", str(tmp_path / "e"), *flags]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1, err
    assert main(["generate", "--model", str(ddim_dir), "a cat", "-o", str(tmp_path / "e")]) == 2
    assert "argument PROMPT: invalid value 'a cat': must be empty: DDIMPipeline takes no prompt" in \
        capsys.readouterr().err


def test_http_extra_params(pag_dir):
    engine = new_engine(pag_dir)
    with serve(create_app(engine, "pag")) as base:
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert card["step_batching"] is False and "pag_scale" in card["extra_parameters"]
        body = {"prompt": "a red door", "size": "64x64", "num_inference_steps": 2, "seed": 3,
                "extra_params": {"pag_scale": 2.0}}
        resp = httpx.post(f"{base}/v1/images/generations", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        data = base64.b64decode(resp.json()["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(data)).size == (64, 64)
        assert read_image_metadata(data)["diffserve"]["extra"] == {"pag_scale": 2.0}
        resp = httpx.post(f"{base}/v1/images/generations", json={**body, "extra_params": {"pag_scal": 2.0}},
                          timeout=60)
        assert_openai_error(resp, 400, param="extra_params")
        assert "pag_scal" in resp.json()["error"]["message"]
