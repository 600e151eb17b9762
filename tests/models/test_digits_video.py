"""Tests of the built-in video model: shipped Wan folder, judge on real samples, data and tokenizer."""

from __future__ import annotations

import copy
import inspect
import json
import random

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.models.digits_video import DEFAULT_MODEL_PATH, VOCABULARY_WORDS, out_of_vocabulary_words
from training.digits import data as digit_data
from training.digits_video import data, train
from diffserve.models.digits_video.tokenizer import build_umt5_tokenizer
from diffserve.pipelines.wan import context_folding as wan_context_folding

import quality  # benchmarks/quality.py (tests/conftest.py puts benchmarks/ on sys.path)
import quality_video

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def shipped_pipe() -> WanPipeline:
    pipe = WanPipeline.from_pretrained(DEFAULT_MODEL_PATH)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def defaults() -> dict:
    return json.loads((DEFAULT_MODEL_PATH / "generation_config.json").read_text())


def test_shipped_folder_is_a_wan_pipeline_within_size_budget(defaults):
    index = json.loads((DEFAULT_MODEL_PATH / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["scheduler"][1] == "UniPCMultistepScheduler"
    assert set(defaults) == {"num_inference_steps", "guidance_scale", "height", "width", "num_frames", "fps", "limits"}
    assert defaults["limits"] == {"max_height": 16, "max_width": 16, "max_num_frames": 9}  # what it was trained on
    assert (defaults["num_frames"] - 1) % 4 == 0 and defaults["height"] % 16 == 0
    image_model = DEFAULT_MODEL_PATH.parents[1] / "digits" / "weights"
    total = sum(f.stat().st_size for d in (DEFAULT_MODEL_PATH, image_model) for f in d.rglob("*") if f.is_file())
    assert total <= 20e6


@pytest.mark.parametrize("overrides,field,message", [
    ({"height": 32, "width": 32}, "height", "invalid height=32: must be a positive multiple of 16 pixels (the "
                                            "model's VAE scale x patch size), at most 16 pixels for this model"),
    ({"num_frames": 97}, "num_frames", "invalid num_frames=97: must be an integer of the form 4*m + 1 in [1, 9]"),
])
def test_the_trained_size_and_length_are_the_limits(overrides, field, message):
    """Trained on 16x16 clips of 9 frames (its generation_config.json says so): larger sizes and
    longer clips are refused by name (they used to run and return noise), and the size rule is
    WanPipeline's multiples of 16, as the model card says (the 4x VAE alone would allow 8)."""
    from diffserve.core.errors import InvalidRequestError

    engine = DiffusionEngine(EngineConfig(model="digits-video", num_threads=1))
    try:
        assert engine.spec.resolution_factor == 16
        assert (engine.spec.max_height, engine.spec.max_width, engine.spec.max_num_frames) == (16, 16, 9)
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("a handwritten digit 3 moving left", SamplingParams(**overrides))
        assert info.value.field == field and str(info.value) == message
        assert "16x16 clips of\n9 frames" in (DEFAULT_MODEL_PATH.parent / "MODEL_CARD.md").read_text()
    finally:
        engine.shutdown()


def test_cli_refuses_beyond_the_stated_limits_before_loading(tmp_path, capsys, monkeypatch):
    """The CLI checks the limits the folder states in its config files before loading the weights
    (the engine is never built)."""
    from diffserve.engine import engine as engine_module
    from diffserve.entrypoints.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "DiffusionEngine", no_load)
    for flags, expected in ((["--size", "32x32"], "argument --size: invalid height=32: must be at most 16 pixels "
                                                  "for this model (the size it was trained for, "
                                                  "generation_config.json limits)"),
                            (["--num-frames", "97"], "argument --num-frames: invalid value 97: must be at most 9 "
                                                     "frames for this model (the length it was trained for")):
        assert main(["generate", "--model", "digits-video", "a digit 3", "-o", str(tmp_path), *flags]) == 2
        assert expected in capsys.readouterr().err


def test_shipped_pipeline_generates_a_clip_of_the_right_shape(shipped_pipe, defaults):
    assert shipped_pipe.vae_scale_factor_temporal == 4
    assert shipped_pipe.vae_scale_factor_spatial == 4
    kwargs = {k: v for k, v in defaults.items() if k not in ("fps", "limits")}
    kwargs["num_inference_steps"] = 4
    frames = shipped_pipe("a handwritten digit 5 moving up", generator=torch.Generator().manual_seed(0),
                          output_type="np", **kwargs).frames
    assert frames.shape == (1, defaults["num_frames"], defaults["height"], defaults["width"], 3)
    assert frames.dtype == np.float32 and np.isfinite(frames).all()
    assert 0.0 <= frames.min() and frames.max() <= 1.0


def test_shipped_model_draws_digits_that_move_as_asked(shipped_pipe, defaults):
    """A quick judge on 10 clips: one per digit, directions in turn (the full judge uses 200).

    The shipped weights read 86 % of these frames right (93 % over the full judge's 200 clips,
    whose VAE-only ceiling is 97 %) and every direction; the thresholds leave a margin below
    that, so a regression in the weights, the pipeline or the judge fails here (the previous
    weights, 71 % here, would).
    """
    clf, heldout_accuracy = quality.build_judge()
    assert heldout_accuracy > 0.98
    requests = [
        quality_video.ClipRequest(f"a handwritten digit {d} moving {data.DIRECTION_NAMES[d % 4]}", d,
                                  data.DIRECTION_NAMES[d % 4])
        for d in range(10)
    ]
    generators = [torch.Generator().manual_seed(200 + k) for k in range(len(requests))]
    clips = shipped_pipe([r.prompt for r in requests], height=defaults["height"], width=defaults["width"],
                         num_frames=defaults["num_frames"], num_inference_steps=10,
                         guidance_scale=defaults["guidance_scale"], generator=generators, output_type="np").frames
    report = quality_video.evaluate(clf, heldout_accuracy, clips, requests, seconds=1.0)
    assert report.frame_accuracy >= 0.75, report
    assert report.direction_accuracy >= 0.9, report


def test_training_clips_move_as_labelled():
    split = digit_data.load_split()
    rng = random.Random(0)
    specs = [data.ClipSpec(int(d), direction) for d in split.train_labels[:16] for direction in data.DIRECTION_NAMES]
    images = np.repeat(split.train_images[:16], len(data.DIRECTION_NAMES), axis=0)
    frames, corners = data.make_clips(images, specs, rng)
    assert frames.shape == (len(specs), data.NUM_FRAMES, data.CANVAS_SIZE, data.CANVAS_SIZE)
    assert corners.min() >= 0 and corners.max() <= data.CANVAS_SIZE - 1
    size = data.CANVAS_SIZE
    starts = set()
    for frame_corners, spec in zip(corners, specs):
        step = np.diff(frame_corners, axis=0)
        expected = np.array(data.DIRECTIONS[spec.direction]) * data.SPEED
        assert (np.mod(step - expected, size) == 0).all()  # the canvas wraps around
        moving_axis = 0 if expected[0] else 1
        assert frame_corners[:, 1 - moving_axis].max() <= size - data.DIGIT_SIZE  # whole across the motion
        starts.add(int(frame_corners[0, moving_axis]))
    assert len(starts) > 8  # clips start anywhere along their motion, not only at an edge
    # every frame holds an exact copy of the digit at its corner, split across the edge if it wraps
    for n in range(len(specs)):
        for f in range(data.NUM_FRAMES):
            r, c = corners[n, f]
            unrolled = np.roll(frames[n, f], (-int(r), -int(c)), axis=(0, 1))
            np.testing.assert_array_equal(unrolled[:8, :8], images[n])
            assert frames[n, f].sum() == images[n].sum()
    assert any(c[:, 1].max() > size - data.DIGIT_SIZE for c in corners)  # some clips do wrap
    # the judge's motion estimate and digit crop agree with the labels on real clips
    gray = frames / digit_data.MAX_INTENSITY
    directions, speeds = quality_video.classify_motion(quality_video.velocities(gray))
    assert directions == [s.direction for s in specs]
    np.testing.assert_allclose(speeds, data.SPEED)
    clf, _ = quality.build_judge()
    predicted, crops = quality_video.judge_frames(clf, gray)
    assert np.mean(predicted == np.array([s.digit for s in specs])[:, None]) >= 0.95
    assert crops.shape == gray.shape[:2] + (8, 8)
    x = data.to_model_range(frames[:2])
    assert x.shape == (2, 3, data.NUM_FRAMES, data.CANVAS_SIZE, data.CANVAS_SIZE)
    assert x.min() == -1 and x.max() == 1


def test_training_clips_use_only_the_training_split():
    split = digit_data.load_split()
    sampler = train.ClipSampler(seed=0)
    assert sampler.images is split.train_images and len(sampler.images) == 1437
    clips = sampler.batch(8)
    assert clips.shape == (8, 3, data.NUM_FRAMES, data.CANVAS_SIZE, data.CANVAS_SIZE)
    # the first frame of every clip holds a training image in one of its 8x8 windows
    frames = np.round((clips[:, 0, 0].numpy() + 1) * digit_data.MAX_INTENSITY / 2)
    train_set = {img.astype(np.float32).tobytes() for img in split.train_images}
    size = data.CANVAS_SIZE
    for frame in frames:
        windows = {np.roll(frame, (-r, -c), axis=(0, 1))[:8, :8].astype(np.float32).tobytes()
                   for r in range(size) for c in range(size)}
        assert windows & train_set


def test_switch_clips_show_another_digit_first_then_the_captioned_one():
    split = digit_data.load_split()
    rng = random.Random(1)
    labels = split.train_labels[:200]
    firsts = data.sample_first_images(labels, split.train_images, split.train_labels, rng, prob=0.5)
    switched = [i for i, f in enumerate(firsts) if f is not None]
    assert 60 < len(switched) < 140
    train_labels = {img.astype(np.float32).tobytes(): int(label)
                    for img, label in zip(split.train_images, split.train_labels)}
    for i in switched:  # frame 0 is a training digit of ANOTHER label
        assert train_labels[firsts[i].astype(np.float32).tobytes()] != labels[i]
    specs = [data.ClipSpec(int(d), "right") for d in labels]
    frames, corners = data.make_clips(split.train_images[:200], specs, rng, first_images=firsts)
    i = switched[0]
    r, c = corners[i, 0]
    np.testing.assert_array_equal(np.roll(frames[i, 0], (-int(r), -int(c)), axis=(0, 1))[:8, :8], firsts[i])
    for f in range(1, data.NUM_FRAMES):  # the rest of the clip: the captioned digit, same path
        r, c = corners[i, f]
        np.testing.assert_array_equal(np.roll(frames[i, f], (-int(r), -int(c)), axis=(0, 1))[:8, :8],
                                      split.train_images[i])
    assert data.sample_first_images(labels, split.train_images, split.train_labels, rng, prob=0.0) == [None] * 200


def test_folded_context_matches_full_512_row_forward():
    torch.manual_seed(0)
    pipe = train.build_pipeline(train.TINY_SIZE)
    with torch.no_grad():  # move near-zero layers off zero so every path matters
        for p in pipe.transformer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert train.MAX_SEQUENCE_LENGTH == inspect.signature(WanPipeline.__call__).parameters["max_sequence_length"].default
    x0 = torch.randn(4, train.TINY_SIZE.z_dim, 3, 8, 8)
    prompts = ["digit 3 moving left", "", "a drawing of seven going up quickly", "nine"]
    wan_context_folding.install_folded_cross_attention(pipe.transformer)
    full = train.rectified_flow_loss(pipe, x0, prompts, torch.Generator().manual_seed(0), fold=False)
    folded = train.rectified_flow_loss(pipe, x0, prompts, torch.Generator().manual_seed(0), fold=True)
    torch.testing.assert_close(folded, full, rtol=1e-5, atol=1e-6)


def test_tokenizer_words_and_shipped_tokenizer_match(shipped_pipe):
    tok = build_umt5_tokenizer()
    for word in VOCABULARY_WORDS:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    ids = tok("a handwritten digit 3 moving left").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["▁a", "▁handwritten", "▁digit", "▁3", "▁moving", "▁left", "</s>"]
    assert tok.unk_token_id not in tok("Digit 42, going UP!").input_ids
    text = "a picture of a seven sliding to the right, please"
    assert shipped_pipe.tokenizer(text).input_ids == tok(text).input_ids


def test_out_of_vocabulary_words():
    assert out_of_vocabulary_words("a digit 3 moving left, please") == ["please"]
    assert out_of_vocabulary_words("Moving the number 42 up") == ["Moving"]
    for subject in digit_data.TRAIN_TEMPLATES + digit_data.HELDOUT_TEMPLATES:
        for motion in data.MOTION_TEMPLATES:
            prompt = data.format_prompt(subject, motion, data.ClipSpec(8, "down"))
            assert out_of_vocabulary_words(prompt) == [], prompt


def test_unclamped_training_decode_matches_the_vae_decode():
    torch.manual_seed(0)
    vae = train.build_pipeline(train.TINY_SIZE).vae
    z = 3 * torch.randn(2, train.TINY_SIZE.z_dim, 3, 4, 4)
    with torch.no_grad():
        stock = vae.decode(z).sample
        ours = train.decode_unclamped(vae, z)
    assert ours.shape == stock.shape == (2, 3, 9, 16, 16)
    torch.testing.assert_close(ours.clamp(-1, 1), stock)


def test_folded_context_forward_matches_the_512_row_forward(shipped_pipe):
    """One transformer forward of the shipped model on the pipeline's own 512-row prompt
    embeddings vs the folded rows diffserve serves with (``fold_padding_rows`` + the folding
    processors). In float64 the two agree to rounding (an identity); in float32 the folded
    forward is within 1e-5 of the float64 result (closer than the 512-row float32 forward,
    whose long softmax sum rounds more: ~1.5e-5)."""
    pipe = shipped_pipe
    prompts = ["a handwritten digit 3 moving left", "the number seven that moves to the right", ""]
    embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512)
    folded = wan_context_folding.fold_padding_rows(embeds)
    assert embeds.shape[1] == 512 and folded.shape[1] == max(len(ids) for ids in pipe.tokenizer(prompts).input_ids) + 1
    x = torch.randn(3, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([999.0, 500.0, 20.0])
    transformer = copy.deepcopy(pipe.transformer)

    def forward(context, dtype):
        transformer.to(dtype)
        return transformer(hidden_states=x.to(dtype), timestep=t.to(dtype), encoder_hidden_states=context.to(dtype),
                           return_dict=False)[0]

    with torch.no_grad():
        full64 = forward(embeds, torch.float64)
        full32 = forward(embeds, torch.float32)
        wan_context_folding.install_folded_cross_attention(transformer, 512)
        folded64 = forward(folded, torch.float64)
        folded32 = forward(folded, torch.float32)
        wan_context_folding.set_max_sequence_length(transformer, None)  # unfolded again: stock diffusers
        stock32 = forward(embeds, torch.float32)
    assert (folded64 - full64).abs().max() <= 1e-12
    assert (folded32 - full64).abs().max() <= 1e-5
    assert (folded32 - full32).abs().max() <= 3e-5
    assert torch.equal(stock32, full32)


def test_served_context_folding_matches_the_full_context():
    """diffserve serves the shipped model with its 512 padded prompt rows folded into one
    (the default); 4 CFG steps give the unfolded run's latents within the batching tolerance
    (float rounding of each forward, ~1e-6, carried through the steps and x4 guidance)."""
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    prompts = ["a handwritten digit 3 moving left", "the number seven that moves to the right"]
    params = [SamplingParams(seed=k, num_inference_steps=4, output_type="latent") for k in range(len(prompts))]
    folded = DiffusionEngine(EngineConfig(model=str(DEFAULT_MODEL_PATH)))
    full = DiffusionEngine(EngineConfig(model=str(DEFAULT_MODEL_PATH), context_folding=False))
    assert folded.runner.adapter.context_folding and not full.runner.adapter.context_folding
    for a, b in zip(folded.generate(prompts, params), full.generate(prompts, params)):
        assert a.ok and b.ok and max(a.metrics.batch_sizes) == 4  # 2 requests x 2 CFG rows
        assert (a.videos[0] - b.videos[0]).abs().max() <= 1e-4


def test_shipped_model_streams_continue_the_motion_and_follow_a_prompt_change():
    """Issue 12's judge on a few seeds, through the engine: chunks 0-1 of "3 moving right" read 3,
    after "8 moving right" (1 transition chunk) the last chunk reads 8, and the digit keeps moving
    right across the seams at the speed it moves within chunks."""
    import streaming_quality  # benchmarks/streaming_quality.py

    from diffserve import DiffusionEngine, EngineConfig

    clf, _ = quality.build_judge()
    engine = DiffusionEngine(EngineConfig(model=str(DEFAULT_MODEL_PATH), max_batch_size=64, num_threads=1))
    seeds = list(range(8))
    updated = streaming_quality.run_streams(engine, seeds, {}, 4, {"prompt": streaming_quality.SECOND,
                                                                   "transition_chunks": 1})
    reads = [[streaming_quality.reads(clf, c) for c in r["chunks"]] for r in updated.values()]
    passed = [r[0] == 3 and r[1] == 3 and r[3] == 8 for r in reads]
    assert sum(passed) >= 6, reads
    assert all(ids == [] for r in updated.values() for k, ids in enumerate(r["event_ids"]) if k != 2)
    plain = streaming_quality.run_streams(engine, seeds, {}, 4, None)
    frames = data.NUM_FRAMES
    seams = [frames + (frames - 1) * k for k in range(3)]
    stats = streaming_quality.seam_stats([r["video"] for r in plain.values()], seams)
    assert 0.5 <= stats["seam_dx"] <= 1.5 and 0.5 <= stats["within_dx"] <= 1.5, stats


@pytest.mark.parametrize("flag", ["--switch-prob", "--first-frame-prob"])
def test_training_refuses_a_probability_outside_0_1(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--out", "unused", flag, "1.5"])
    assert exc.value.code == 2
    assert f"{flag} must be a fraction in [0, 1], got 1.5" in capsys.readouterr().err
    assert getattr(train.parse_args(["--out", "unused", flag, "0.25"]), flag[2:].replace("-", "_")) == 0.25
