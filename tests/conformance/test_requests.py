"""What every family does with a request besides its pixels: optional fields used or refused by
name, the event sequence (queued, started, progress, partial previews, finished) with metrics,
every output type, the folder's ``generation_config.json`` defaults, and abort (the runner drops
the request's state and its batch slot goes to the next waiting request)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tiny_models.registry import MODELS, OPTIONAL_FIELDS, model_ids

from diffserve import DiffusionEngine, EngineConfig, EventType, InvalidRequestError, SamplingParams

from .harness import BATCH_TOL, PROMPT, assert_close, input_image, media, request_image, run, runner_request_ids

#: A value of each optional field that is valid wherever the field is used.
FIELD_VALUES = {"guidance_scale": 2.0, "true_cfg_scale": 2.0, "guidance_scale_2": 2.0, "max_sequence_length": 16,
                "num_frames": 5, "fps": 8, "strength": 0.5, "num_chunks": 2}


def _unused_fields():
    """(model id, field) for every optional field a model does not use (a mask needs an image:
    asked only of models that take images)."""
    return [pytest.param(m.id, name, id=f"{m.id}-{name}") for m in MODELS for name in OPTIONAL_FIELDS
            if name not in m.fields and (name != "mask" or m.images != "none")]


def _drain(engine) -> list:
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    return events


@pytest.mark.parametrize("model,name", [p for p in _unused_fields()], indirect=["model"])
def test_unused_field_is_refused_by_name(model, served, name):
    """A field the family does not use is an `InvalidRequestError` naming the field and the
    pipeline class, at `add_request`, before anything is queued."""
    image = request_image(model)
    if name in ("image", "mask"):
        from diffserve.core.inputs import make_inputs

        picture = input_image(model)
        inputs = make_inputs(picture, mask=np.zeros(picture.size[::-1], np.uint8)) if name == "mask" else picture
        params = model.params()
    else:
        inputs, params = image, model.params(**{name: FIELD_VALUES[name]})
    with pytest.raises(InvalidRequestError) as info:
        served.add_request(PROMPT, params, inputs=inputs)
    assert info.value.field == name, f"{model.id}: refusing {name} named {info.value.field!r}: {info.value}"
    assert model.pipeline in str(info.value), f"{model.id}: the refusal of {name} does not name the model: " \
                                              f"{info.value}"
    assert not served.has_unfinished_requests()


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_used_fields_are_accepted(model, served):
    """Each field the family uses is accepted with a valid value (the request is queued, then
    aborted); an edit family refuses a request without its input image, naming ``image``."""
    image = request_image(model)
    for name, value in model.fields.items():
        if name == "image":
            continue
        kwargs = {name: value}
        if name == "true_cfg_scale":
            kwargs["negative_prompt"] = "blurry"
        inputs = input_image(model) if name == "strength" else image
        request_id = served.add_request(PROMPT, model.params(**kwargs), inputs=inputs)
        assert served.abort(request_id)
    if model.images == "optional":
        assert served.abort(served.add_request(PROMPT, model.params(), inputs=input_image(model)))
    events = _drain(served)
    assert {e.type for e in events} <= {EventType.QUEUED, EventType.ABORTED}
    if model.images == "required":
        with pytest.raises(InvalidRequestError) as info:
            served.add_request(PROMPT, model.params())
        assert info.value.field == "image" and model.pipeline in str(info.value), str(info.value)


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_events_previews_and_metrics(model, served):
    """queued, started, one progress per step (of the planned total), a decoded preview at the
    asked step, finished with the output and its metrics (stage timings, forwards, memory)."""
    params = model.params(seed=3, num_inference_steps=3, **model.guided)
    events = [e for e in _run_events(served, params, request_image(model), preview_steps=[2])]
    kinds = [e.type for e in events]
    assert kinds[:2] == [EventType.QUEUED, EventType.STARTED] and kinds[-1] is EventType.FINISHED, kinds
    total = model.forwards(3)
    progress = [(e.step, e.total) for e in events if e.type is EventType.PROGRESS]
    assert progress == [(s, total) for s in range(1, total + 1)], f"{model.id}: progress events {progress}"
    [partial] = [e for e in events if e.type is EventType.PARTIAL]
    out = events[-1].output
    assert partial.step == 2 and partial.preview is not None
    preview = np.stack(partial.preview) if model.video else np.asarray(partial.preview)
    assert preview.shape == media(out).shape, f"{model.id}: preview {preview.shape} vs output {media(out).shape}"
    m = out.metrics
    assert m.num_steps == total and m.batch_sizes == {2: total}, f"{model.id}: metrics {m.as_dict()}"
    assert m.encode_s > 0 and m.denoise_s > 0 and m.decode_s > 0 and m.total_s >= m.denoise_s
    assert m.queue_s >= 0 and m.peak_memory_bytes > 0
    assert set(m.as_dict()) >= {"queue_s", "encode_s", "denoise_s", "decode_s", "total_s", "num_steps",
                                "batch_sizes", "peak_memory_bytes"}


def _run_events(engine, params, image, **kwargs):
    request_id = engine.add_request(PROMPT, params, inputs=image, **kwargs)
    return [e for e in _drain(engine) if e.request_id == request_id]


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_output_types(model, served):
    """The same request as pil, np, pt and latent (sharing forwards): the same pixels in each
    form; images float in [0, 1], video frames uint8."""
    image = request_image(model)
    types = ("np", "pil", "pt", "latent")
    outs = served.generate([PROMPT] * 4, [model.params(seed=5, output_type=t) for t in types], inputs=image)
    for out in outs:
        assert out.ok, out.error
    height, width = model.request["height"], model.request["width"]
    as_np, as_pil, as_pt, latent = (out.videos[0] if model.video else out.images for out in outs)
    if model.video:
        frames = model.request["num_frames"]
        assert as_np.shape == (frames, height, width, 3) and as_np.dtype == np.uint8
        pil = np.stack([np.asarray(f) for f in as_pil])
        assert as_pt.dtype == torch.uint8 and tuple(as_pt.shape) == as_np.shape
        pt = as_pt.numpy()
    else:
        assert as_np.shape == (1, height, width, model.channels) and as_np.dtype == np.float32
        assert 0 <= as_np.min() and as_np.max() <= 1
        assert len(as_pil) == 1 and as_pil[0].size == (width, height)
        pil = np.asarray(as_pil[0]).reshape(1, height, width, model.channels)
        assert as_pt.shape == (1, model.channels, height, width)
        pt = as_pt.permute(0, 2, 3, 1).numpy()
    assert_close(model, "pil vs np output", pil, as_np, 1 / 255 + 1e-6)
    assert_close(model, "pt vs np output", pt, as_np, 1 / 255 + 1e-6 if model.video else BATCH_TOL)
    assert isinstance(latent, torch.Tensor) and latent.is_floating_point() and torch.isfinite(latent).all()


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_generation_config_sets_the_defaults(model, folder, tmp_path):
    """The folder's ``generation_config.json`` overrides the family's diffusers defaults (and a
    request that sets nothing is accepted with them)."""
    copy = shutil.copytree(folder, tmp_path / "model")
    config_path = copy / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    defaults = {"num_inference_steps": 3, "height": model.request["height"], "width": model.request["width"]}
    for name, value in (("guidance_scale", 2.5), ("true_cfg_scale", 1.5), ("guidance_scale_2", 3.5),
                        ("max_sequence_length", 24), ("num_frames", 9), ("fps", 24)):
        if name in model.fields:
            defaults[name] = value
    config_path.write_text(json.dumps({**config, **defaults}))
    engine = DiffusionEngine(EngineConfig(model=str(copy)))
    got = {name: getattr(engine.spec, f"default_{name}") for name in defaults}
    assert got == defaults, f"{model.id}: spec defaults {got}, generation_config.json {defaults}"
    assert engine.abort(engine.add_request(PROMPT, SamplingParams(seed=1), inputs=request_image(model)))
    assert [e.type for e in _drain(engine)] == [EventType.QUEUED, EventType.ABORTED]
    engine.shutdown()


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_abort_frees_state_and_slot(model, served):
    """Two requests fill the batch and a third waits; aborting one mid-run drops its state in the
    runner at the next step, where the waiting request takes its place; the others finish as
    they do alone and the runner ends holding nothing."""
    rows = 2  # each request below: one image, guided
    engine = DiffusionEngine(EngineConfig(model=str(served.config.model), max_batch_size=2 * rows,
                                          overlap_stages=False), runner=served.runner)
    image = request_image(model)
    kwargs = {"output_type": "latent" if model.video else "np", **model.guided}  # (video pixels are uint8)
    jobs = {"first": ("a red car", model.params(seed=1, num_inference_steps=3, **kwargs)),
            "aborted": ("a blue car", model.params(seed=2, num_inference_steps=50, **kwargs)),
            "waiting": ("a green car", model.params(seed=3, num_inference_steps=2, **kwargs))}
    ids = {name: engine.add_request(prompt, params, inputs=image) for name, (prompt, params) in jobs.items()}
    names = {request_id: name for name, request_id in ids.items()}
    events = engine.step() + engine.step()
    assert engine.queue_position(ids["waiting"]) == 1, f"{model.id}: the third request was admitted"
    assert ids["aborted"] in runner_request_ids(engine)
    assert engine.abort(ids["aborted"])
    step = engine.step()
    events += step
    assert ids["aborted"] not in runner_request_ids(engine), f"{model.id}: the runner still holds the aborted state"
    kinds = {(names[e.request_id], e.type) for e in step}
    assert ("aborted", EventType.ABORTED) in kinds and ("waiting", EventType.STARTED) in kinds, \
        f"{model.id}: the aborted request's slot was not reused at once: {sorted(kinds)}"
    events += _drain(engine)
    finals = {names[e.request_id]: e.output for e in events if e.type.is_final}
    assert finals["aborted"].status == "aborted" and 1 <= finals["aborted"].metrics.num_steps <= 2
    assert finals["first"].ok, finals["first"].error
    prompt, params = jobs["waiting"]
    assert_close(model, "abort: the request in the freed slot vs solo", media(finals["waiting"]),
                 media(run(served, prompt, params, image)), BATCH_TOL)
    assert not runner_request_ids(engine), f"{model.id}: runner holds {runner_request_ids(engine)}"
    assert not engine.abort(ids["aborted"])  # already ended


@pytest.mark.parametrize("model", model_ids(lambda m: "num_chunks" in m.fields), indirect=True)
def test_video_stream(model, served):
    """A two-chunk stream: one chunk event per chunk (the second without the frame it repeats),
    then the whole video, frames uint8."""
    frames = model.request["num_frames"]
    params = model.params(seed=2, num_chunks=2, **model.guided)
    events = _run_events(served, params, request_image(model))
    chunks = [e for e in events if e.type is EventType.CHUNK]
    assert [c.chunk_index for c in chunks] == [0, 1], f"{model.id}: chunk events {[c.chunk_index for c in chunks]}"
    assert [c.output.shape[0] for c in chunks] == [frames, frames - 1]
    assert events[-1].type is EventType.FINISHED, events[-1]
    [video] = events[-1].output.videos
    assert video.dtype == np.uint8 and video.shape == (2 * frames - 1, model.request["height"],
                                                      model.request["width"], 3)
    np.testing.assert_array_equal(video, np.concatenate([c.output for c in chunks]))


@pytest.mark.parametrize("model", model_ids(), indirect=True)
def test_long_prompts_are_truncated_and_flagged(model, served):
    """A prompt (and a negative prompt) beyond the text encoders' token budget runs truncated
    and the output says so (a family that never cuts its text never flags it); a short one is
    not flagged."""
    long = " ".join(["a very long prompt about a red apple on a wooden table"] * 10)  # > 77 CLIP tokens
    kwargs = {**model.guided, "negative_prompt": long, "num_inference_steps": 1 if model.one_step else 2}
    if "max_sequence_length" in model.fields:
        kwargs["max_sequence_length"] = 16
    short = "a red apple"  # (the built-in digits model's CLIP takes 10 tokens)
    outs = served.generate([long, short], [model.params(**kwargs), model.params(**{**kwargs, "negative_prompt": "x"})],
                           inputs=request_image(model))
    flags = [(o.prompt_truncated, o.negative_prompt_truncated) for o in outs]
    cut = model.cuts_text
    assert flags == [(cut, cut), (False, False)], f"{model.id}: (prompt, negative) truncated flags {flags}"
