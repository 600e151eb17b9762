"""The built-in `digits-reasoning` model: shipped weights and card, the language model's answers,
a quick judge (the image shows the answer), and the DiT really reading the LM's K/V (another
request's K/V make it draw the other answer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffserve.models import BUILTIN_MODELS
from diffserve.pipelines.ar_context import export_kv, prompt_input_ids
from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline

import quality  # benchmarks/quality.py (tests/conftest.py puts benchmarks/ on sys.path)
from training.digits_reasoning import grammar
from training.digits_reasoning.tokenizer import build_tokenizer

MODEL = BUILTIN_MODELS["digits-reasoning"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pipe() -> DigitsReasoningPipeline:
    pipe = DigitsReasoningPipeline.from_pretrained(MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_shipped_folder_and_card():
    index = json.loads((MODEL / "model_index.json").read_text())
    assert index["_class_name"] == "DigitsReasoningPipeline"
    assert index["language_model"] == ["transformers", "Qwen2ForCausalLM"]
    size = sum(f.stat().st_size for f in MODEL.rglob("*") if f.is_file())
    assert size <= 20e6
    card = (MODEL.parent / "MODEL_CARD.md").read_text()
    assert "python -m training.digits_reasoning.train" in card and "| `python benchmarks/quality_reasoning.py" in card


def test_tokenizer_matches_the_training_tokenizer(pipe):
    built = build_tokenizer()
    for problem in grammar.all_problems()[::37]:
        assert prompt_input_ids(pipe.tokenizer, problem.prompt) == prompt_input_ids(built, problem.prompt)


def test_language_model_answers_heldout_prompts(pipe):
    held = grammar.split()[1]
    texts, sequences = pipe.generate_answers([p.prompt for p in held])
    assert np.mean([t == p.answer_text for t, p in zip(texts, held)]) >= 0.95
    assert all(s[-1] == pipe.tokenizer.eos_token_id for s in sequences)


def test_quick_judge_and_the_dit_reads_the_kv(pipe):
    held = grammar.split()[1]
    problems = [held[k * 7 % len(held)] for k in range(20)]
    prompts = [p.prompt for p in problems]
    answers = np.array([p.answer for p in problems])
    generators = lambda: [torch.Generator().manual_seed(k) for k in range(len(prompts))]  # noqa: E731
    out = pipe(prompts, num_inference_steps=10, generator=generators(), output_type="np")
    clf, _ = quality.build_judge()
    assert np.mean(quality.judge_images(clf, out.images) == answers) >= 0.85
    _, sequences = pipe.generate_answers(prompts)
    kv = export_kv(pipe.language_model, sequences, pipe.tokenizer.pad_token_id)
    swapped = [kv[(k + 1) % len(kv)] for k in range(len(kv))]
    out = pipe(prompts, num_inference_steps=10, generator=generators(), output_type="np", ar_kv=swapped)
    predicted = quality.judge_images(clf, out.images)
    assert np.mean(predicted == answers) <= 0.3
    others = np.roll(answers, -1)
    assert np.mean(predicted == others) >= 0.8  # it draws the other request's answer
