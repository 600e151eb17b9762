"""Input validation: every rule names its field and range; seeds; prompt truncation."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams


@pytest.mark.parametrize(
    "kwargs,field,fragment",
    [
        ({"num_inference_steps": 0}, "num_inference_steps", "[1, 200]"),
        ({"num_inference_steps": 201}, "num_inference_steps", "[1, 200]"),
        ({"num_inference_steps": 2.5}, "num_inference_steps", "integer"),
        ({"height": 40}, "height", "multiple of 16"),
        ({"width": 0}, "width", "multiple of 16"),
        ({"width": -16}, "width", "multiple of 16"),
        ({"guidance_scale": -1.0}, "guidance_scale", "[0, 100]"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "finite"),
        ({"guidance_scale": 1e30}, "guidance_scale", "[0, 100]"),
        ({"height": 1024}, "height", "at most 512 pixels"),  # pos_embed_max_size 32 x 2 x 8
        ({"negative_prompt": "\ud800"}, "negative_prompt", "Unicode"),
        ({"num_images_per_prompt": 0}, "num_images_per_prompt", "[1, 10]"),
        ({"num_images_per_prompt": 11}, "num_images_per_prompt", "[1, 10]"),
        ({"seed": -1}, "seed", "[0, "),
        ({"seed": True}, "seed", "integer"),
        ({"output_type": "gif"}, "output_type", "pil"),
        ({"negative_prompt": 3}, "negative_prompt", "string"),
    ],
)
def test_invalid_params_name_field_and_range(engine, kwargs, field, fragment):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("a cat", SamplingParams(**kwargs))
    assert info.value.field == field
    assert field in str(info.value) and fragment in str(info.value)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt", ["", "   \n\t", None, 5, b"7", "\ud800"])
def test_bad_prompts_rejected(engine, prompt):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt)
    assert info.value.field == "prompt"


def test_numpy_and_torch_scalars_are_accepted(engine):
    import numpy as np
    import torch

    params = SamplingParams(seed=np.int64(3), num_inference_steps=torch.tensor(2).item() and np.int32(2),
                            guidance_scale=np.float32(3.0), output_type="np")
    [out] = engine.generate("a cat", params)
    assert out.ok and out.seed == 3 and out.metrics.num_steps == 2


@pytest.mark.parametrize("prompts,params,field", [
    (None, None, "prompts"), (123, None, "prompts"), ([], None, "prompts"),
    ("a", {"seed": 1}, "params"), (["a", "b"], "ab", "params"), (["a", "b"], [SamplingParams(), None], "params"),
    (["a", "b"], [SamplingParams()], "params"),
])
def test_generate_rejects_bad_argument_types(engine, prompts, params, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(prompts, params)
    assert info.value.field == field


def test_invalid_request_error_is_value_error():
    assert issubclass(InvalidRequestError, ValueError)


def test_limits_are_configurable(tiny_sd3_dir):
    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_num_inference_steps=5,
                                       max_pixels=64 * 64, max_num_images_per_prompt=2))
    for kwargs, field in (({"num_inference_steps": 6}, "num_inference_steps"),
                          ({"height": 80}, "size"), ({"num_images_per_prompt": 3}, "num_images_per_prompt")):
        with pytest.raises(InvalidRequestError) as info:
            eng.add_request("x", SamplingParams(**kwargs))
        assert info.value.field == field


def test_oversized_request_is_rejected_before_any_allocation(engine):
    # 2048x2048 on a 64x64 model is allowed by default; a 1e5-px side is not, and fails in add_request
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", SamplingParams(height=160000, width=160000))


def test_explicit_seed_is_byte_identical(engine):
    params = SamplingParams(num_inference_steps=2, seed=1234, output_type="np")
    [a] = engine.generate("a tree", params)
    [b] = engine.generate("a tree", params)
    assert a.seed == b.seed == 1234
    assert a.images.tobytes() == b.images.tobytes()


def test_missing_seed_is_drawn_reported_and_reproducible(engine):
    [a] = engine.generate("a tree", SamplingParams(num_inference_steps=2, output_type="np"))
    [b] = engine.generate("a tree", SamplingParams(num_inference_steps=2, output_type="np"))
    assert isinstance(a.seed, int) and a.seed != b.seed
    [again] = engine.generate("a tree", SamplingParams(num_inference_steps=2, seed=a.seed, output_type="np"))
    assert again.images.tobytes() == a.images.tobytes()


def test_default_seed_policy(tiny_sd3_dir):
    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), default_seed=99))
    [out] = eng.generate("x", SamplingParams(num_inference_steps=1))
    assert out.seed == 99


def test_long_prompt_is_truncated_and_flagged(engine, tiny_sd3_t5_dir):
    long_prompt = "a very long prompt " * 20  # > 77 CLIP tokens on the char-level tokenizer
    [out] = engine.generate(long_prompt, SamplingParams(num_inference_steps=1, seed=0, output_type="np"))
    assert out.ok and out.prompt_truncated
    [short] = engine.generate("a cat", SamplingParams(num_inference_steps=1, seed=0))
    assert not short.prompt_truncated
    # deterministic: truncation cuts at the same place every time
    [again] = engine.generate(long_prompt, SamplingParams(num_inference_steps=1, seed=0, output_type="np"))
    assert np.array_equal(out.images, again.images)


def test_truncation_verdicts_are_remembered_per_text(engine, monkeypatch):
    """Each distinct (text, max_sequence_length) is tokenized once; the memo is bounded."""
    import diffserve.pipelines.text_encoding as text_encoding

    text = engine.executor.runner.adapter.text
    calls = []
    real = text._tokenize_is_truncated
    monkeypatch.setattr(text, "_tokenize_is_truncated", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(text_encoding, "TRUNCATION_MEMO_SIZE", 2)
    monkeypatch.setattr(text, "_truncated", type(text._truncated)())  # start empty (shared engine)
    long_prompt = "a very long prompt " * 20
    assert [text.is_truncated(t) for t in (long_prompt, "a cat", long_prompt, "a cat")] == [True, False, True, False]
    assert len(calls) == 2
    text.is_truncated("a dog")  # evicts the least recently used (the long prompt)
    assert text.is_truncated(long_prompt) and len(calls) == 4
    assert len(text._truncated) <= 2


def test_engine_config_rejects_bad_values():
    for kwargs, field in (({"max_batch_size": 0}, "max_batch_size"), ({"execution_mode": "x"}, "execution_mode"),
                          ({"load_format": "gguf"}, "load_format"), ({"dtype": "int3"}, "dtype"),
                          ({"num_threads": 0}, "num_threads"), ({"device": None}, "device"),
                          ({"device": "tpu"}, "device"), ({"model": 123}, "model"),
                          ({"default_seed": -1}, "default_seed"), ({"compile_vae": True}, "compile_vae")):
        with pytest.raises(InvalidRequestError) as info:
            EngineConfig(**kwargs)
        assert info.value.field == field
