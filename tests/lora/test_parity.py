"""LoRA adapters per request on every step-batched family: images equal diffusers'
``load_lora_weights`` + ``set_adapters`` (one adapter; two adapters at other scales; the same
with adapter A in the family's non-diffusers layout, e.g. kohya) within one uint8 level, and one step batch
mixing adapter A, adapter B, A+B at other scales and no adapter equals each request run alone
(1e-4) with one denoiser forward per step.

Adapters are random (`tests/lora/families.py`): A covers the denoiser and, where diffusers loads
LoRA into them, the text encoders (kohya ``lora_te``); B only the denoiser, another rank and alpha.
"""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models.loras import diffusers_reference as with_adapters
from tiny_models.loras import save_diffusers_lora, save_file_lora
from tiny_models.registry import BY_ID

from ..conformance.harness import (
    BATCH_TOL,
    PROMPT,
    assert_close,
    diffusers_reference,
    media,
    reference_pipeline,
    request_image,
    run,
)
from .families import FAMILIES

#: One folder per family, and the built-in models.
MODEL_IDS = ["StableDiffusion3Pipeline", "StableDiffusion3Pipeline-digits", "FluxPipeline-schnell",
             "FluxKontextPipeline", "StableDiffusionPipeline", "StableDiffusionXLPipeline", "QwenImagePipeline",
             "QwenImageEditPipeline", "WanPipeline-2.1", "WanPipeline-digits-video"]
ONE_LEVEL = 1 / 255


@pytest.fixture(params=MODEL_IDS)
def setup(request, tiny_folder, tmp_path):
    """(model, folder, engine with adapters A, A in the non-diffusers layout, B; the diffusers
    reference pipeline; adapter files)."""
    from diffserve import DiffusionEngine, EngineConfig

    model = BY_ID[request.param]
    with model.patch():
        folder = tiny_folder(model.id)
        family = FAMILIES[model.pipeline]
        pipe = reference_pipeline(model, folder)
        cls = type(pipe)
        a_parts = family.parts(pipe, seed=1)
        files = {"A": save_diffusers_lora(cls, tmp_path / "A", a_parts),
                 "B": save_diffusers_lora(cls, tmp_path / "B", family.parts(pipe, seed=2, rank=2, alpha=1.0,
                                                                            text=False))}
        loads = dict(files)
        if family.layout is not None:
            loads["A_layout"] = save_file_lora(family.non_diffusers(pipe, a_parts), tmp_path / "A_layout.safetensors")
        engine = DiffusionEngine(EngineConfig(model=str(folder), loras={k: str(v) for k, v in loads.items()},
                                              max_batch_size=32, overlap_stages=False))
        try:
            yield model, folder, engine, pipe, files
        finally:
            assert not engine.has_unfinished_requests()
            engine.shutdown()


def test_adapters_match_diffusers(setup):
    model, folder, engine, pipe, files = setup
    assert {e["name"]: e["state"] for e in engine.list_loras()}.items() >= {"A": "ready", "B": "ready"}.items()
    params = model.params(seed=7, **model.guided)
    image = request_image(model)
    names = {e["name"] for e in engine.list_loras()}
    cases = [({"A": 1.0}, {"A": 1.0}), ({"A": 0.7, "B": -0.5}, {"A": 0.7, "B": -0.5})]
    if "A_layout" in names:
        cases += [({"A_layout": 1.0}, {"A": 1.0}), ({"A_layout": 0.7, "B": -0.5}, {"A": 0.7, "B": -0.5})]
    base = media(run(engine, PROMPT, params, image))
    for request_loras, reference_loras in cases:
        out = run(engine, PROMPT, dataclasses.replace(params, loras=request_loras), image)
        got = media(out)
        reference = diffusers_reference(model, folder, PROMPT, out.params, image,
                                        pipe=with_adapters(pipe, files, reference_loras))
        assert_close(model, f"LoRA {request_loras} vs diffusers set_adapters", got, reference, ONE_LEVEL)
        assert abs(got.astype(float) - base.astype(float)).max() > 0, f"{model.id}: {request_loras} changed nothing"


def test_mixed_batch_equals_each_alone(setup):
    model, folder, engine, pipe, files = setup
    image = request_image(model)
    requests = [{"A": 1.0}, {"B": 1.0}, {"A": 0.5, "B": 1.5}, None]
    output_type = "latent" if model.video else "np"  # video pixels are uint8: compare latents
    params = [model.params(seed=11 + i, output_type=output_type, **model.guided, loras=loras)
              for i, loras in enumerate(requests)]
    alone = [media(run(engine, PROMPT, p, image)) for p in params]
    ids = [engine.add_request(PROMPT, p, inputs=image) for p in params]
    outs = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.type.is_final:
                outs[event.request_id] = event.output
    rows = 2 * len(requests)  # guided: two rows each
    for i, request_id in enumerate(ids):
        out = outs[request_id]
        assert out.ok, out.error
        assert out.metrics.batch_sizes == {rows: model.forwards(params[i].num_inference_steps)}, \
            f"{model.id}: expected every step to be one forward of the {rows} rows of all four requests"
        assert_close(model, f"mixed batch vs alone ({requests[i]})", media(out), alone[i], BATCH_TOL)
