"""Quantized weights through the engine: offline API, memory accounting and admission, stats
and ``/v1/models``, the automatic skip list at load, GGUF and pre-quantized folders, and the
composition with step batching, sleep mode, offload, compile, cache backends and CFG-parallel."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.core.errors import UnsupportedModelError
from diffserve.core.tensor_storage import tensor_bytes
from diffserve.quantization.apply import is_quantized_tensor

JOBS = [  # different prompts, seeds, step counts, CFG on and off: they share steps
    ("a red fox", SamplingParams(seed=1, num_inference_steps=4, output_type="np")),
    ("a blue bird", SamplingParams(seed=2, num_inference_steps=3, output_type="np", guidance_scale=1.0)),
    ("a green tree", SamplingParams(seed=3, num_inference_steps=4, output_type="np", num_images_per_prompt=2)),
]
#: batched vs alone, offloaded vs resident (same arithmetic): the unquantized engine's tolerance
BATCH_TOL = 1e-5
#: int8_dynamic rounds each token's activations to int8: float noise of 1e-6 between a row
#: computed in a batch of 2 and alone (attention kernels) can flip a rounding, one quantization
#: step (~1 % of the token's largest value); outputs then agree to this PSNR (dB), not to 1e-5
DYNAMIC_PSNR = 40


def _images(engine, jobs=JOBS):
    outs = engine.generate([p for p, _ in jobs], [s for _, s in jobs])
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.images for o in outs]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of images in [0, 1]."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1 / mse)


def _engine(model_dir, **kw) -> DiffusionEngine:
    return DiffusionEngine(EngineConfig(model=str(model_dir), **kw))


@pytest.fixture(scope="module")
def plain_images(engine):
    return _images(engine)


@pytest.fixture(scope="module")
def int8_engine(tiny_sd3_dir):
    return _engine(tiny_sd3_dir, quantization="int8_dynamic", enable_sleep_mode=True)


@pytest.fixture(scope="module")
def int8_images(int8_engine):
    return _images(int8_engine)


def test_int8_engine_serves_close_to_fp32_and_batches(tiny_sd3_dir, int8_engine, int8_images, plain_images):
    for got, want in zip(int8_images, plain_images):
        assert psnr(got, want) > 30
    alone = [int8_engine.generate(p, s)[0].images for p, s in JOBS]  # each request alone
    for got, want in zip(alone, int8_images):
        assert psnr(got, want) > DYNAMIC_PSNR
    weight_only = _engine(tiny_sd3_dir, quantization="int8_weight_only")  # float activations: batch invariant
    batched = _images(weight_only)
    for (prompt, params), want in zip(JOBS, batched):
        [got] = weight_only.generate(prompt, params)
        assert np.abs(got.images - want).max() <= BATCH_TOL


def test_memory_accounting_reads_real_storage(int8_engine, engine):
    """The offload manager's bytes (what admission and stats use) are the tensor subclasses' real
    storage; every quantized component is smaller than the same component unquantized."""
    ours = int8_engine.runner.memory.offload.bytes
    theirs = engine.runner.memory.offload.bytes
    modules = int8_engine.runner.adapter.modules()
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        expected = sum(tensor_bytes(t) for t in {id(t): t for t in [*modules[name].parameters(),
                                                                    *modules[name].buffers()]}.values())
        assert ours[name] == expected < theirs[name]
    assert ours["vae"] == theirs["vae"]
    stats = int8_engine.stats()
    report = stats["quantization"]["components"]
    assert set(report) == {"transformer", "text_encoder", "text_encoder_2"}
    assert all(report[c]["bytes"] == ours[c] for c in report)
    assert stats["offload"]["resident_weight_bytes"] == sum(ours.values())
    assert int8_engine.executor.memory_profile().weight_bytes == sum(ours.values())


def test_builtin_model_int8_components_within_0_30_of_fp32():
    """The issue's bound, on the built-in model, as the engine's own accounting reports it."""
    fp32 = DiffusionEngine(EngineConfig()).runner.memory.offload.bytes
    for method in ("int8_weight_only", "int8_dynamic"):
        engine = DiffusionEngine(EngineConfig(quantization=method))
        quantized = engine.stats()["quantization"]["components"]
        ours = engine.runner.memory.offload.bytes
        assert sum(ours[c] for c in quantized) <= 0.30 * sum(fp32[c] for c in quantized), method
        assert ours["transformer"] <= 0.30 * fp32["transformer"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_the_quantized_weights(int8_engine, int8_images, level):
    transformer = int8_engine.runner.adapter.modules()["transformer"]
    int8_engine.sleep(level)
    int8_engine.wake_up()
    assert is_quantized_tensor(transformer.transformer_blocks[0].attn.to_q.weight)
    assert all(np.array_equal(a, b) for a, b in zip(_images(int8_engine), int8_images))
    assert int8_engine.stats()["quantization"]["components"]["transformer"]["bytes"] == \
        int8_engine.runner.memory.offload.bytes["transformer"]


@pytest.mark.parametrize("options", [{"cpu_offload": True}, {"layerwise_offload": True, "offload_blocks": 1}],
                         ids=["model-offload", "layerwise-offload"])
def test_offload_composes(tiny_sd3_dir, int8_images, options):
    engine = _engine(tiny_sd3_dir, quantization="int8_dynamic", **options)
    for got, want in zip(_images(engine), int8_images):
        assert np.abs(got - want).max() <= BATCH_TOL


def test_compile_and_cache_backend_compose_without_recompiles(tmp_path_factory, monkeypatch):
    """Regional compile + TeaCache on int8_dynamic weights: requests at several batch sizes
    run without a recompile after warm-up, close to the eager quantized engine; TeaCache skips
    the same steps. Dynamo's guards on the tensor subclasses (what decides recompiles) are the
    same with any backend; the ``eager`` backend skips AOT
    autograd and inductor's code generation (minutes for quantized blocks on this CPU).
    benchmarks/quantization.py --compile runs inductor and reports the recompiles after warm-up
    of every trial."""
    from tiny_models import build_tiny_sd3

    monkeypatch.setattr("diffserve.acceleration.compile.COMPILE_BACKEND", "eager")
    one_block = build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_quant_compile"), num_layers=1)
    cache = {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.3}, "quantization": "int8_dynamic"}
    eager = _engine(one_block, **cache)
    compiled = _engine(one_block, compile=True, max_batch_size=2, **cache)
    for engine in (eager, compiled):
        engine.generate(["a red fox", "a blue bird", "a cat"],
                        [SamplingParams(seed=i, num_inference_steps=6, output_type="np") for i in range(3)])
    want = _images(eager, JOBS[:2])
    got = _images(compiled, JOBS[:2])
    for a, b in zip(got, want):
        assert psnr(a, b) > DYNAMIC_PSNR
    stats = compiled.stats()["acceleration"]
    assert stats["compile"]["enabled"] and stats["compile"]["recompiles_after_warmup"] == 0
    assert stats["cache_backend"]["skipped"] == eager.stats()["acceleration"]["cache_backend"]["skipped"] > 0


def test_cfg_parallel_composes(tiny_sd3_dir):
    """Each rank quantizes its own copy the same way and runs one CFG branch: the same images
    as one process, to int8_dynamic's batch tolerance (a branch runs as 1 row instead of 2)."""
    single = _engine(tiny_sd3_dir, quantization="int8_dynamic")
    want = _images(single, JOBS[:2])
    engine = _engine(tiny_sd3_dir, quantization="int8_dynamic", cfg_parallel_size=2, num_threads=1)
    try:
        got = _images(engine, JOBS[:2])
        assert engine.model_info.quantization["components"]["transformer"]["method"] == "int8_dynamic"
    finally:
        engine.shutdown()
    for a, b in zip(got, want):
        assert psnr(a, b) > DYNAMIC_PSNR


def test_automatic_skip_list_at_load_is_reported(tiny_sd3_dir):
    engine = _engine(tiny_sd3_dir, quantization={"transformer": "int8_dynamic"}, quantization_skip="auto",
                     quantization_error_budget=0.004)
    report = engine.stats()["quantization"]["components"]["transformer"]
    assert report["kept_layers"] and all(k.startswith("transformer.") for k in report["kept_layers"])
    assert report["error"] <= 0.004
    modules = engine.runner.adapter.modules()["transformer"]
    for name in report["kept_layers"]:
        assert type(modules.get_submodule(name.split(".", 1)[1]).weight) is torch.nn.Parameter
    assert "text_encoder" not in engine.stats()["quantization"]["components"]
    [out] = engine.generate(*JOBS[0])
    assert out.ok


def test_models_route_reports_quantization(int8_engine):
    from diffserve import AsyncDiffusionEngine
    from diffserve.entrypoints.openai.app import create_app

    with TestClient(create_app(AsyncDiffusionEngine(engine=int8_engine), "tiny")) as client:
        [card] = client.get("/v1/models").json()["data"]
    quantization = card["quantization"]
    assert quantization["methods"] == "int8_dynamic" and quantization["skip"] is None
    transformer = quantization["components"]["transformer"]
    assert transformer["source"] == "quantized at load" and transformer["ratio"] < 0.6
    assert transformer["kept_layers"] == []


def test_bad_quantization_is_refused_at_start(tiny_sd3_dir):
    with pytest.raises(InvalidRequestError, match="quantization.*component of this model: .*transformer"):
        _engine(tiny_sd3_dir, quantization={"transfomer": "int8_dynamic"})
    for method in ("float8", "int4_weight_only"):
        with pytest.raises(InvalidRequestError, match=f"{method} needs a cuda device"):
            EngineConfig(model=str(tiny_sd3_dir), device="cpu", quantization=method)
    with pytest.raises(InvalidRequestError, match="transformer_file.*dummy"):
        EngineConfig(model=str(tiny_sd3_dir), load_format="dummy", transformer_file="x.gguf")


def test_gguf_transformer_through_the_engine(tiny_sd3_dir, tiny_flux_dir, plain_images, tmp_path):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    from tiny_models.gguf import write_gguf

    sd3 = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir / "transformer")
    path = write_gguf(sd3.state_dict(), tmp_path / "sd3-Q8_0.gguf")
    engine = _engine(tiny_sd3_dir, transformer_file=str(path), quantization="int8_weight_only")
    components = engine.stats()["quantization"]["components"]
    assert components["transformer"]["method"] == "gguf:Q8_0" and components["transformer"]["source"] == "gguf file"
    assert components["text_encoder"]["method"] == "int8_weight_only"
    for got, want in zip(_images(engine), plain_images):
        assert psnr(got, want) > 30
    engine.sleep(2)  # level 2 reloads the GGUF file and re-quantizes the text encoders
    engine.wake_up()
    assert type(engine.runner.adapter.modules()["transformer"].transformer_blocks[0].attn.to_q.weight).__name__ \
        == "GGUFParameter"
    flux = write_gguf(FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer").state_dict(),
                      tmp_path / "flux.gguf", arch="flux")
    with pytest.raises(UnsupportedModelError, match="flux.gguf .*architecture 'flux'.* does not hold this "
                                                    "folder's SD3Transformer2DModel"):
        _engine(tiny_sd3_dir, transformer_file=str(flux))


def test_prequantized_folder_through_the_engine(tiny_sd3_dir, plain_images, tmp_path):
    from diffusers import SD3Transformer2DModel, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    folder = tmp_path / "prequantized"
    shutil.copytree(tiny_sd3_dir, folder)
    shutil.rmtree(folder / "transformer")
    SD3Transformer2DModel.from_pretrained(tiny_sd3_dir / "transformer", torch_dtype=torch.float32,
                                          quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
                                          ).save_pretrained(folder / "transformer")
    engine = _engine(folder)
    [card] = [engine.model_info.quantization["components"]]
    assert card["transformer"]["method"] == "torchao:Int8WeightOnlyConfig"
    assert card["transformer"]["source"] == "pre-quantized folder"
    for got, want in zip(_images(engine), plain_images):
        assert psnr(got, want) > 30


def test_whole_request_runner_quantizes_and_refuses_auto(tiny_sd3_dir):
    fallback = "diffusers:StableDiffusion3Pipeline"
    engine = _engine(tiny_sd3_dir, custom_pipeline=fallback, quantization="int8_weight_only")
    assert not engine.model_info.step_batching
    assert engine.model_info.quantization["components"]["transformer"]["quantized_layers"] > 0
    [out] = engine.generate(*JOBS[0])
    assert out.ok, out.error
    with pytest.raises(InvalidRequestError, match="quantization_skip.*no step adapter"):
        _engine(tiny_sd3_dir, custom_pipeline=fallback, quantization="int8_weight_only", quantization_skip="auto")


def test_cli_flags_reach_the_engine_config():
    from diffserve.entrypoints.cli_args import build_parser
    from diffserve.entrypoints.engine_args import check_engine_arguments, engine_config_from_args

    args = build_parser().parse_args(["serve", "--quantization", "transformer=int8_dynamic,text_encoder=none",
                                      "--quantization-skip", "*.ff.net.2", "--quantization-error-budget", "0.05"])
    check_engine_arguments(args)
    config = engine_config_from_args(args)
    assert config.quantization_spec.methods == {"transformer": "int8_dynamic", "text_encoder": None}
    assert config.quantization_spec.skip == ("*.ff.net.2",) and config.quantization_error_budget == 0.05


def test_cli_generate_with_quantization_and_bad_method(tiny_sd3_dir, tmp_path, capsys):
    from PIL import Image

    from diffserve.entrypoints.cli import main

    rc = main(["generate", "--model", str(tiny_sd3_dir), "--prompt", "a cat", "--steps", "2", "--size", "32x32",
               "--threads", "1", "--quantization", "transformer=int8_weight_only,text_encoder=none",
               "-o", str(tmp_path / "ok")])
    assert rc == 0
    [path] = capsys.readouterr().out.split()
    assert Image.open(path).size == (32, 32)
    assert main(["generate", "--model", str(tiny_sd3_dir), "a cat", "--quantization", "int9",
                 "-o", str(tmp_path / "x")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("diffserve: error: argument --quantization: invalid value 'int9'")
    assert "int8_weight_only" in line and "int8_dynamic" in line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("method", ["int8_weight_only", "int8_dynamic"])
def test_lora_adapters_on_quantized_weights(method):
    """A LoRA adapter on a quantized base: the delta runs in full precision on top of the int8
    layers (the built-in `mirror` adapter still mirrors: the quick judge passes), requests with
    and without it share step batches, and the images stay close to the unquantized engine's
    with the same adapter."""
    from quality import build_judge, judge_images, make_prompts
    from training.digits import data

    clf, _ = build_judge()
    prompts, labels = make_prompts(data.TRAIN_TEMPLATES, 1)  # 10 prompts, one per digit
    params = [SamplingParams(seed=k % 10, num_inference_steps=8, output_type="np",
                             loras={"mirror": 1.0} if k < 10 else None) for k in range(20)]
    images = {}
    for arm in ("fp32", method):
        engine = DiffusionEngine(EngineConfig(max_batch_size=40, overlap_stages=False, num_threads=1,
                                              quantization=None if arm == "fp32" else arm))
        outs = engine.generate(prompts + prompts, params)
        assert all(o.ok for o in outs), [o.error for o in outs]
        images[arm] = np.stack([np.asarray(o.images)[0, :, :, 0] for o in outs])
        if arm != "fp32":
            assert max(outs[0].metrics.batch_sizes) == 40  # adapter and plain rows in one forward
            [solo] = engine.generate(prompts[3], params[3])  # a mirrored row alone equals its batched self
            assert psnr(np.asarray(solo.images)[0, :, :, 0], images[arm][3]) > DYNAMIC_PSNR
    styled, plain = images[method][:10], images[method][10:]
    assert np.mean(judge_images(clf, styled[:, :, ::-1].copy()) == labels) >= 0.9
    assert np.mean(judge_images(clf, plain) == labels) >= 0.9
    # measured: 49.1 / 49.6 dB (int8_weight_only), 42.4 / 43.8 dB (int8_dynamic)
    assert psnr(styled, images["fp32"][:10]) > 35 and psnr(plain, images["fp32"][10:]) > 35
