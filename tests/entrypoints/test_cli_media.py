"""``diffserve edit`` (image-to-image on the built-in model), ``diffserve generate`` on a video
model (MP4 / WebP / GIF files with their metadata), and built-in models by name (``digits``,
``digits-video``) in the CLI, the offline API and ``serve``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.cli import main
from diffserve.entrypoints.openai.app import default_served_model_name
from diffserve.media.video_encoding import decode_mp4, read_mp4_metadata
from diffserve.core.errors import UnsupportedModelError
from diffserve.models import BUILTIN_MODELS, builtin_name, resolve_model, served_name
from diffserve.models.digits import DEFAULT_MODEL_PATH
from training.digits import data

torch.set_num_threads(1)


def run(argv, capsys):
    """``main(argv)`` -> (exit status, stdout lines, stderr lines); argparse's own exits count."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out.split(), [line for line in err.splitlines() if not line.startswith("denoising")]


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> Path:
    split = data.load_split()
    image = split.heldout_images[split.heldout_labels == 3][0] / data.MAX_INTENSITY
    path = tmp_path_factory.mktemp("inputs") / "three.png"
    Image.fromarray((image * 255).round().astype(np.uint8)).save(path)
    return path


# --------------------------------------------------------------------------------- edit
def test_edit_writes_pngs_with_the_strength_in_their_metadata(three, tmp_path, capsys):
    from quality import build_judge, judge_images

    rc, paths, _ = run(["edit", "--image", str(three), "the number eight", "--strength", "0.9", "--seed", "4",
                        "-n", "2", "--model", "digits", "--threads", "1", "-o", str(tmp_path)], capsys)
    assert rc == 0 and [Path(p).name for p in paths] == ["0001_seed4.png", "0002_seed5.png"]
    image = Image.open(paths[0])
    assert image.size == (8, 8)  # the input's size
    fields = json.loads(image.text["diffserve"])
    assert (fields["strength"], fields["seed"], fields["model"]) == (0.9, 4, "diffserve-digits")
    assert image.text["parameters"].endswith("Model: diffserve-digits, Denoising strength: 0.9")
    pixels = np.stack([np.asarray(Image.open(p).convert("L"), dtype=np.float64) / 255 for p in paths])
    assert (judge_images(build_judge()[0], pixels) == 8).all()
    # the offline API gives the same image for the same request
    [out] = DiffusionEngine(EngineConfig(num_threads=1)).generate(
        "the number eight", SamplingParams(strength=0.9, seed=4), inputs=Image.open(three))
    assert np.array_equal(np.asarray(out.images[0]), np.asarray(image))


@pytest.mark.parametrize("args,fragment", [
    (["--image", "/no/such.png"], "argument --image: invalid value '/no/such.png': must be a readable PNG"),
    (["--image", __file__], "argument --image: invalid value"),
    (["--image", "THREE", "--mask", "SMALL"], "argument --mask: invalid value '4x4': must be the image's size 8x8"),
    (["--image", "THREE", "--strength", "0"], "argument --strength: invalid value 0.0: must be a number in (0, 1]"),
    (["--image", "THREE", "--strength", "1e-300"], "argument --strength: invalid value 1e-300: must be large enough"),
    (["--image", "THREE", "--image", "THREE"], "argument --image: invalid value '2 images'"),
    (["--image", "THREE", "--mask", "THREE"], "argument --mask: invalid value '<mask>': must be absent"),
])
def test_edit_errors_name_the_flag(three, tmp_path, capsys, args, fragment):
    small = tmp_path / "small.png"
    Image.new("L", (4, 4)).save(small)
    args = [str(three) if a == "THREE" else str(small) if a == "SMALL" else a for a in args]
    rc, _, err = run(["edit", "the number eight", *args, "--threads", "1", "-o", str(tmp_path / "out")], capsys)
    assert rc == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "out").exists()


def test_edit_on_a_model_without_image_inputs(tiny_wan_dir, three, tmp_path, capsys):
    rc, _, err = run(["edit", "--image", str(three), "a cat", "--model", str(tiny_wan_dir), "-o", str(tmp_path)],
                     capsys)
    assert rc == 2 and "argument --image" in err[0] and "takes no input images" in err[0], err


# -------------------------------------------------------------------------------- video
VIDEO = ["--size", "48x32", "--num-frames", "9", "--steps", "2", "--threads", "1"]


def test_generate_video_writes_mp4_with_metadata_tags(tiny_wan_dir, tmp_path, capsys):
    rc, paths, err = run(["generate", "a cat", "--model", str(tiny_wan_dir), *VIDEO, "--fps", "10", "--seed", "3",
                          "-n", "2", "-o", str(tmp_path)], capsys)
    assert rc == 0 and [Path(p).name for p in paths] == ["0001_seed3.mp4", "0002_seed4.mp4"], err
    payload = Path(paths[0]).read_bytes()
    frames, fps = decode_mp4(payload)
    assert frames.shape == (9, 32, 48, 3) and fps == 10
    tags = read_mp4_metadata(payload)
    fields = json.loads(tags["diffserve"])
    assert (fields["num_frames"], fields["fps"], fields["seed"], fields["width"]) == (9, 10, 3, 48)
    assert tags["comment"].startswith("a cat\nSteps: 2, CFG scale: 5, Seed: 3, Size: 48x32")
    assert tags["comment"].endswith("Frames: 9, FPS: 10")
    assert not list(tmp_path.glob("*.json"))  # mp4 carries its metadata itself


@pytest.mark.parametrize("fmt", ["webp", "gif"])
def test_generate_video_as_webp_or_gif_with_a_sidecar_and_display_size(tiny_wan_dir, tmp_path, capsys, fmt):
    rc, paths, _ = run(["generate", "a cat", "--model", str(tiny_wan_dir), *VIDEO, "--seed", "1", "--video-format",
                        fmt, "--display-size", "96", "-o", str(tmp_path)], capsys)
    assert rc == 0 and paths == [str(tmp_path / f"0001_seed1.{fmt}")]
    shown, raw = Image.open(paths[0]), Image.open(tmp_path / f"0001_seed1_raw.{fmt}")
    assert shown.size == (96, 64) and raw.size == (48, 32) and shown.n_frames == raw.n_frames == 9
    sidecar = json.loads((tmp_path / "0001_seed1.json").read_text())
    assert (sidecar["prompt"], sidecar["num_frames"], sidecar["seed"]) == ("a cat", 9, 1)


@pytest.mark.parametrize("args,fragment", [
    (["--num-frames", "8"], "argument --num-frames: invalid value 8: must be an integer of the form 4*m + 1"),
    (["--fps", "0"], "argument --fps: invalid value 0: must be an integer in [1, 240]"),
    (["--video-format", "avi"], "argument --video-format: invalid choice: 'avi'"),
])
def test_video_flag_errors(tiny_wan_dir, tmp_path, capsys, args, fragment):
    rc, _, err = run(["generate", "a cat", "--model", str(tiny_wan_dir), "--size", "48x32", *args,
                      "-o", str(tmp_path / "out")], capsys)
    assert rc == 2 and len(err) == 1 and fragment in err[0], err


def test_video_flags_on_an_image_model(tmp_path, capsys):
    for args, flag in [(["--video-format", "gif"], "--video-format"), (["--num-frames", "5"], "--num-frames")]:
        rc, _, err = run(["generate", "a handwritten digit 1", *args, "--threads", "1", "-o", str(tmp_path)], capsys)
        assert rc == 2 and err[0].startswith(f"diffserve: error: argument {flag}: invalid value"), err


# ------------------------------------------------------------------------- model names
def test_builtin_names_resolve_in_the_offline_api(tmp_path, monkeypatch):
    assert EngineConfig().model_path == EngineConfig(model="digits").model_path == DEFAULT_MODEL_PATH
    assert EngineConfig(model="digits-video").model_path == BUILTIN_MODELS["digits-video"]
    assert BUILTIN_MODELS["digits-video"].parent.name == "digits_video"
    assert [served_name(m) for m in (None, "digits", DEFAULT_MODEL_PATH, "digits-video")] == [
        "diffserve-digits", "diffserve-digits", "diffserve-digits", "diffserve-digits-video"]
    assert builtin_name(tmp_path) is None and served_name(tmp_path) == tmp_path.name
    # an existing folder of that name wins over the built-in name
    (tmp_path / "digits").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("digits") == Path("digits") and builtin_name("digits") is None


def test_digits_video_name_loads_its_folder(tiny_wan_dir, monkeypatch):
    """Until the trained model ships, the name points at a tiny Wan folder here: the engine,
    the served name and the CLI follow the name to whatever folder it stands for."""
    monkeypatch.setitem(BUILTIN_MODELS, "digits-video", Path(tiny_wan_dir))
    config = EngineConfig(model="digits-video", num_threads=1)
    engine = DiffusionEngine(config)
    assert engine.spec.default_num_frames is not None
    assert default_served_model_name(config) == "diffserve-digits-video"
    [out] = engine.generate("a cat", SamplingParams(height=32, width=48, num_frames=5, num_inference_steps=1,
                                                    output_type="np"))
    assert out.videos[0].shape == (5, 32, 48, 3)


def test_unknown_names_and_missing_builtins_get_clear_messages(tmp_path, capsys, monkeypatch):
    rc, _, err = run(["generate", "a cat", "--model", "no-such-model", "-o", str(tmp_path)], capsys)
    assert rc == 2 and err == ["diffserve: error: model folder no-such-model does not exist, and 'no-such-model' "
                               "is not a built-in model name (digits, digits-video, digits-reasoning), nor a Hugging Face Hub id "
                               "(ORG/NAME)"]
    monkeypatch.setitem(BUILTIN_MODELS, "digits-video", tmp_path / "not-installed")
    with pytest.raises(UnsupportedModelError, match="the built-in model 'digits-video' is not part of this "
                                                    "installation"):
        DiffusionEngine(EngineConfig(model="digits-video"))
