"""The whole-request fallback (any diffusers pipeline class without a step adapter) and
custom pipelines: same queue, events, limits and abort as adapters; diffusers' own output."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig, EventType, InvalidRequestError, SamplingParams
from diffserve.core.inputs import make_inputs


def _retag(folder, tmp_path, class_name):
    out = tmp_path / class_name
    shutil.copytree(folder, out)
    index = json.loads((out / "model_index.json").read_text())
    index["_class_name"] = class_name
    (out / "model_index.json").write_text(json.dumps(index))
    return out


@pytest.fixture(scope="module")
def img2img_dir(tiny_sd3_dir, tmp_path_factory):
    return _retag(tiny_sd3_dir, tmp_path_factory.mktemp("fallback"), "StableDiffusion3Img2ImgPipeline")


def _image(seed=0, size=64):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _mask(size=64):
    mask = np.zeros((size, size), np.uint8)
    mask[16:48, 16:48] = 255
    return Image.fromarray(mask)


def _reference(cls, folder, **kwargs):
    pipe = cls.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    seed = kwargs.pop("seed")
    return pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs).images


def test_img2img_class_is_served_whole_request_with_diffusers_output(img2img_dir):
    engine = DiffusionEngine(EngineConfig(model=str(img2img_dir)))
    assert engine.model_info.step_batching is False
    assert engine.model_info.pipeline == "StableDiffusion3Img2ImgPipeline"
    events = []
    [out] = engine.generate("a red door", SamplingParams(seed=4, num_inference_steps=5, strength=0.8,
                                                        guidance_scale=5.0, output_type="np"),
                            inputs=_image(), on_event=events.append)
    assert out.ok, out.error
    ref = _reference(StableDiffusion3Img2ImgPipeline, img2img_dir, prompt="a red door", image=_image(),
                     strength=0.8, num_inference_steps=5, guidance_scale=5.0, height=64, width=64, seed=4)
    np.testing.assert_array_equal(out.images, ref)  # its own pipeline call: exact
    progress = [e.step for e in events if e.type is EventType.PROGRESS]
    assert progress == [1, 2, 3, 4] and out.metrics.num_steps == 4  # strength 0.8 of 5 steps


def test_sd_inpaint_class_with_a_mask(tiny_sd15_dir, tmp_path):
    from diffusers import StableDiffusionInpaintPipeline

    folder = _retag(tiny_sd15_dir, tmp_path, "StableDiffusionInpaintPipeline")
    engine = DiffusionEngine(EngineConfig(model=str(folder)))
    assert engine.model_info.step_batching is False and engine.spec.accepts_images
    [out] = engine.generate("a red door", SamplingParams(seed=4, num_inference_steps=3, strength=1.0,
                                                        guidance_scale=5.0, height=64, width=64, output_type="np"),
                            inputs=make_inputs(_image(), _mask()))
    assert out.ok, out.error
    pipe = StableDiffusionInpaintPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a red door", image=_image(), mask_image=_mask(), strength=1.0, num_inference_steps=3,
               guidance_scale=5.0, height=64, width=64, generator=torch.Generator().manual_seed(4),
               output_type="np").images
    np.testing.assert_array_equal(out.images, ref)


def test_img2img_class_runs_requests_in_order_and_aborts(img2img_dir):
    engine = DiffusionEngine(EngineConfig(model=str(img2img_dir), overlap_stages=False))
    jobs = [("a boat", SamplingParams(seed=1, num_inference_steps=4, strength=1.0, output_type="np")),
            ("a kite", SamplingParams(seed=2, num_inference_steps=6, strength=0.5, output_type="np"))]
    solo = [engine.generate(p, s, inputs=_image(i))[0].images for i, (p, s) in enumerate(jobs)]
    ids = [engine.add_request(p, s, inputs=_image(i)) for i, (p, s) in enumerate(jobs)]
    doomed = engine.add_request("never", SamplingParams(seed=3, num_inference_steps=50, strength=1.0),
                                inputs=_image(3))
    finals, order = {}, []
    while engine.has_unfinished_requests():
        for e in engine.step():
            if e.type is EventType.PROGRESS:
                order.append(e.request_id)
                if e.request_id == doomed and e.step == 2:
                    engine.abort(doomed)
            if e.type.is_final:
                finals[e.request_id] = e.output
    assert finals[doomed].status.value == "aborted" and finals[doomed].metrics.num_steps == 2
    for request_id, expected in zip(ids, solo):
        assert finals[request_id].ok
        np.testing.assert_array_equal(finals[request_id].images, expected)
    # no shared forwards: the request scheduler runs the oldest request's key, so requests run in
    # arrival order, each to its end (the lowest latency without batching)
    assert order == [ids[0]] * 4 + [ids[1]] * 3 + [doomed] * 2
    ref = _reference(StableDiffusion3Img2ImgPipeline, img2img_dir, prompt="a kite", image=_image(1),
                     strength=0.5, num_inference_steps=6, height=64, width=64, seed=2)
    np.testing.assert_array_equal(finals[ids[1]].images, ref)


def test_fallback_refuses_what_its_call_does_not_take(img2img_dir):
    engine = DiffusionEngine(EngineConfig(model=str(img2img_dir)))
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("x", SamplingParams(true_cfg_scale=2.0), inputs=_image())
    assert info.value.field == "true_cfg_scale"
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("x", SamplingParams(), inputs=make_inputs(_image(), _mask()))
    assert info.value.field == "mask"
    with pytest.raises(InvalidRequestError) as info:
        DiffusionEngine(EngineConfig(model=str(img2img_dir), cache_backend="teacache"))
    assert info.value.field == "cache_backend" and "StableDiffusion3Img2ImgPipeline" in str(info.value)


def test_custom_step_adapter_is_served_with_step_batching(tiny_sd3_dir):
    custom = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), custom_pipeline="custom_pipelines:NegatedSD3Adapter"))
    plain = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir)))
    params = [SamplingParams(seed=s, num_inference_steps=3, output_type="np") for s in (1, 2)]
    outs = custom.generate(["a", "b"], params)
    refs = plain.generate(["a", "b"], params)
    assert custom.model_info.step_batching
    for out, ref in zip(outs, refs):
        assert np.abs(out.images - (1.0 - ref.images)).max() <= 1e-4
        assert max(out.metrics.batch_sizes) == 4  # batched with the other request


def test_custom_call_only_pipeline_gets_the_fallback(tiny_sd3_dir):
    from custom_pipelines import NegatedSD3Pipeline

    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), load_format="custom_pipeline",
                                          custom_pipeline="custom_pipelines:NegatedSD3Pipeline"))
    assert engine.model_info.step_batching is False
    [out] = engine.generate("a cat", SamplingParams(seed=9, num_inference_steps=2, output_type="np"))
    pipe = NegatedSD3Pipeline.from_pretrained(tiny_sd3_dir, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a cat", num_inference_steps=2, height=64, width=64, generator=torch.Generator().manual_seed(9),
               output_type="np").images
    np.testing.assert_array_equal(out.images, ref)


@pytest.mark.parametrize("target,fragment", [("nomodule", "package.module:ClassName"),
                                             ("no_such_module:X", "cannot import"),
                                             ("custom_pipelines:Missing", "no class")])
def test_bad_custom_pipeline_names(tiny_sd3_dir, target, fragment):
    from diffserve import UnsupportedModelError

    with pytest.raises((UnsupportedModelError, InvalidRequestError), match=fragment):
        DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), custom_pipeline=target))


def test_video_pipeline_through_the_fallback_keeps_folder_settings(tiny_wan22_dir):
    """A Wan 2.2 folder served whole-request (custom class = diffusers' own WanPipeline): the
    folder's pipeline settings (boundary_ratio) reach the pipeline, and frames come back as
    uint8 (F, H, W, 3) like the step adapter's."""
    from diffusers import WanPipeline

    engine = DiffusionEngine(EngineConfig(model=str(tiny_wan22_dir), custom_pipeline="diffusers:WanPipeline"))
    assert engine.model_info.step_batching is False and engine.spec.default_num_frames is not None
    params = SamplingParams(seed=2, num_inference_steps=2, height=32, width=48, num_frames=5, output_type="np")
    [out] = engine.generate("a red ball", params)
    assert out.ok, out.error
    [video] = out.videos
    assert video.dtype == np.uint8 and video.shape == (5, 32, 48, 3)
    pipe = WanPipeline.from_pretrained(tiny_wan22_dir)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a red ball", num_inference_steps=2, height=32, width=48, num_frames=5,
               generator=torch.Generator().manual_seed(2), output_type="np").frames[0]
    assert np.abs(video.astype(np.float64) - (ref * 255).round()).max() <= 1
    # whole requests cannot stream chunks: refused, naming the field
    assert engine.model_info.chunk_streaming is False
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("a red ball", SamplingParams(num_chunks=2, height=32, width=48, num_frames=5))
    assert info.value.field == "num_chunks" and "whole-request" in str(info.value)
