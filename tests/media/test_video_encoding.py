"""Video encoders: MP4 (H.264 via PyAV), animated WebP and GIF (Pillow) round-trip."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from diffserve.media.video_encoding import (
    VIDEO_FORMATS,
    as_frames,
    decode_mp4,
    encode_gif,
    encode_mp4,
    encode_video,
    encode_webp,
)


def _clip(frames=9, height=32, width=48) -> np.ndarray:
    """Smooth gradients that move with the frame index (what codecs keep well)."""
    y, x = np.mgrid[0:height, 0:width]
    clip = np.empty((frames, height, width, 3), np.uint8)
    for i in range(frames):
        clip[i, ..., 0] = (x * 4 + i * 8) % 256
        clip[i, ..., 1] = y * 6
        clip[i, ..., 2] = i * 25
    return clip


def test_mp4_decodes_back_to_the_frames():
    clip = _clip()
    data = encode_mp4(clip, fps=16)
    assert data[4:8] == b"ftyp"
    frames, fps = decode_mp4(data)
    assert frames.shape == clip.shape and fps == 16
    error = np.abs(frames.astype(int) - clip)
    assert error.mean() < 4 and np.percentile(error, 99) < 20  # lossy, yuv420p chroma


def test_mp4_single_frame_and_fractional_rate():
    frames, fps = decode_mp4(encode_mp4(_clip(frames=1, height=16, width=16), fps=29.97))
    assert frames.shape == (1, 16, 16, 3) and abs(fps - 29.97) < 0.01


@pytest.mark.parametrize("encode,fmt,duration", [(encode_webp, "WEBP", 62), (encode_gif, "GIF", 60)])
def test_animated_image_formats(encode, fmt, duration):
    clip = _clip()
    image = Image.open(io.BytesIO(encode(clip, fps=16)))
    assert image.format == fmt and image.n_frames == 9 and image.size == (48, 32)
    image.seek(4)
    image.load()
    assert image.info["duration"] == duration and image.info["loop"] == 0
    assert np.abs(np.asarray(image.convert("RGB")).astype(int) - clip[4]).mean() < 8


def test_inputs_tensor_and_pil_list_equal_the_array():
    clip = _clip(frames=3)
    as_pil = [Image.fromarray(f) for f in clip]
    assert np.array_equal(as_frames(torch.from_numpy(clip)), clip)
    assert np.array_equal(as_frames(as_pil), clip)
    assert encode_video(clip, 8, "gif") == encode_gif(as_pil, 8)
    assert set(VIDEO_FORMATS) == {"mp4", "webp", "gif"}


@pytest.mark.parametrize("video,fps,fragment", [
    (np.zeros((2, 8, 8, 3), np.float32), 8, "uint8"),
    (np.zeros((8, 8, 3), np.uint8), 8, "shape"),
    (np.zeros((0, 8, 8, 3), np.uint8), 8, "shape"),
    (np.zeros((2, 8, 8, 4), np.uint8), 8, "shape"),
    (np.zeros((2, 8, 8, 3), np.uint8), 0, "fps"),
    (np.zeros((2, 9, 8, 3), np.uint8), 8, "even"),
])
def test_bad_inputs_name_the_problem(video, fps, fragment):
    with pytest.raises(ValueError, match=fragment):
        encode_mp4(video, fps)


def test_unknown_format():
    with pytest.raises(ValueError, match="mp4, webp, gif"):
        encode_video(_clip(frames=1), 8, "avi")
