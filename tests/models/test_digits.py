"""Tests of the built-in digits model: shipped weights, tokenizer, judge and training entry point."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffserve.pipelines.sd3.context_folding import install_folded_context_attention
from diffserve.pipelines.sd3.adapter import DEFAULT_MAX_SEQUENCE_LENGTH
from diffusers import StableDiffusion3Pipeline

from diffserve.models import digits as digits_package
from diffserve.models.digits import DEFAULT_MODEL_PATH, VOCABULARY_WORDS, out_of_vocabulary_words
from training.digits import data, train
from diffserve.models.digits.tokenizer import MODEL_MAX_LENGTH, build_clip_tokenizer

import quality  # benchmarks/quality.py (tests/conftest.py puts benchmarks/ on sys.path)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _load(path: Path) -> StableDiffusion3Pipeline:
    # diffusers 0.42.1 does not treat a null text_encoder_3 in model_index.json as optional:
    # the T5 slots must be passed explicitly.
    pipe = StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def shipped_pipe() -> StableDiffusion3Pipeline:
    return _load(DEFAULT_MODEL_PATH)


def test_default_model_path_is_package_relative():
    assert DEFAULT_MODEL_PATH.is_dir()
    assert DEFAULT_MODEL_PATH.parent == Path(digits_package.__file__).resolve().parent == train.PACKAGE_DIR
    index = json.loads((DEFAULT_MODEL_PATH / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_PATH.rglob("*") if f.is_file())
    assert size <= 20e6


def test_shipped_pipeline_config(shipped_pipe):
    assert shipped_pipe.vae_scale_factor == 1
    assert shipped_pipe.tokenizer.model_max_length == MODEL_MAX_LENGTH
    assert shipped_pipe.text_encoder.config.eos_token_id == shipped_pipe.tokenizer.eos_token_id
    assert shipped_pipe.text_encoder_3 is None


def test_shipped_model_draws_legible_digits(shipped_pipe):
    clf, heldout_accuracy = quality.build_judge()
    assert heldout_accuracy > 0.98
    digits = [0, 3, 7]
    prompts = [f"a handwritten digit {d}" for d in digits]
    generators = [torch.Generator().manual_seed(100 + k) for k in range(len(digits))]
    images = shipped_pipe(prompts, height=8, width=8, num_inference_steps=12, generator=generators,
                          output_type="np").images
    assert images.shape == (3, 8, 8, 1) and images.dtype == np.float32
    assert list(quality.judge_images(clf, images)) == digits


def test_generation_is_deterministic(shipped_pipe):
    def run():
        return shipped_pipe("seven", height=8, width=8, num_inference_steps=4,
                            generator=torch.Generator().manual_seed(5), output_type="np").images

    np.testing.assert_array_equal(run(), run())


def test_tokenizer_never_produces_unknown_and_truncates():
    tok = build_clip_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id == tok.unk_token_id
    for word in VOCABULARY_WORDS:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    ids = tok("a handwritten digit 3, please ☺ zyxw").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.eos_token_id not in ids[1:-1]  # the comma / unknown word did not become EOS
    assert tok.convert_ids_to_tokens(ids[1:5]) == ["a</w>", "handwritten</w>", "digit</w>", "3</w>"]
    long = tok("the number seven " * 10, truncation=True).input_ids
    assert len(long) == MODEL_MAX_LENGTH and long[-1] == tok.eos_token_id


def test_shipped_tokenizer_matches_builder(shipped_pipe):
    built = build_clip_tokenizer()
    text = "Handwritten THREE, drawn by a café robot!"
    for tok in (shipped_pipe.tokenizer, shipped_pipe.tokenizer_2):
        assert tok(text).input_ids == built(text).input_ids


def test_out_of_vocabulary_words():
    assert out_of_vocabulary_words("A handwritten digit 3, please!") == ["please"]
    assert out_of_vocabulary_words("the number 42") == []
    assert out_of_vocabulary_words("Seven cats, seven") == ["cats"]
    for template in data.TRAIN_TEMPLATES + data.HELDOUT_TEMPLATES:
        assert out_of_vocabulary_words(data.format_prompt(template, 8)) == []


def test_split_is_fixed_and_disjoint():
    split = data.load_split()
    assert split.train_images.shape == (1437, 8, 8) and split.heldout_images.shape == (360, 8, 8)
    assert np.bincount(split.heldout_labels).min() >= 35
    x, y = data.train_tensors()
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.min() == -1 and x.max() == 1
    assert not set(data.TRAIN_TEMPLATES) & set(data.HELDOUT_TEMPLATES)


def test_collapsed_zero_context_matches_full_forward():
    torch.manual_seed(0)
    pipe = train.build_pipeline(train.TINY_SIZE)
    with torch.no_grad():  # move zero-initialised layers off zero so every path matters
        for p in pipe.transformer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x0 = torch.randn(4, 1, 8, 8)
    prompts = ["digit 3", "", "a drawing of seven", "nine"]
    full = train.rectified_flow_loss(pipe, x0, prompts, torch.Generator().manual_seed(0), collapse=False)
    install_folded_context_attention(pipe.transformer, DEFAULT_MAX_SEQUENCE_LENGTH)
    collapsed = train.rectified_flow_loss(pipe, x0, prompts, torch.Generator().manual_seed(0), collapse=True)
    torch.testing.assert_close(collapsed, full, rtol=1e-5, atol=1e-6)


def test_tiny_training_run_loads(tmp_path):
    out = train.main(["--tiny", "--max-steps", "3", "--out", str(tmp_path / "model"), "--threads", "1"])
    assert (out / "MODEL_CARD.md").is_file()
    pipe = _load(out)
    image = pipe("digit 3", height=8, width=8, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), output_type="np").images
    assert image.shape == (1, 8, 8, 1) and np.isfinite(image).all()
