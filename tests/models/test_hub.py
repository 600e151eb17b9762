"""Models by Hugging Face Hub id (`diffserve.models.hub`): which files a pipeline needs, a real Hub
cache layout resolved offline through `huggingface_hub`, and the online path of the real library
against a local server speaking the Hub's HTTP API (`fake_hub`): ``diffserve download``, the
token from the environment, ``--download-dir``, errors; nothing reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.core.errors import UnsupportedModelError
from diffserve.models import BUILTIN_MODELS, resolve_model, served_name
from diffserve.models.hub import HubId, files_to_fetch, parse_hub_id

from .fake_hub import FakeHub, repo_from_folder

DIGITS = BUILTIN_MODELS["digits"]
SHA = "0123456789abcdef0123456789abcdef01234567"

#: The file list of an SD 1.5 repository (runwayml/stable-diffusion-v1-5's layout): several
#: formats and variants of every component, single-file checkpoints at the top.
SD15_FILES = [
    ".gitattributes", "README.md", "model_index.json", "v1-5-pruned.ckpt", "v1-5-pruned.safetensors",
    "v1-5-pruned-emaonly.ckpt", "v1-5-pruned-emaonly.safetensors", "v1-inference.yaml",
    "feature_extractor/preprocessor_config.json",
    "safety_checker/config.json", "safety_checker/model.fp16.safetensors", "safety_checker/model.safetensors",
    "safety_checker/pytorch_model.bin", "safety_checker/pytorch_model.fp16.bin",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json", "text_encoder/model.fp16.safetensors", "text_encoder/model.safetensors",
    "text_encoder/pytorch_model.bin", "text_encoder/pytorch_model.fp16.bin", "text_encoder/flax_model.msgpack",
    "tokenizer/merges.txt", "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "unet/config.json", "unet/diffusion_pytorch_model.bin", "unet/diffusion_pytorch_model.fp16.bin",
    "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_pytorch_model.non_ema.bin",
    "unet/diffusion_pytorch_model.non_ema.safetensors", "unet/diffusion_pytorch_model.safetensors",
    "unet/diffusion_flax_model.msgpack",
    "vae/config.json", "vae/diffusion_pytorch_model.bin", "vae/diffusion_pytorch_model.fp16.bin",
    "vae/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.safetensors",
    "onnx/unet/model.onnx",
]
SD15_INDEX = {
    "_class_name": "StableDiffusionPipeline", "feature_extractor": ["transformers", "CLIPImageProcessor"],
    "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"], "scheduler": ["diffusers", "PNDMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
}
_CONFIGS = ["feature_extractor/preprocessor_config.json", "model_index.json", "safety_checker/config.json",
            "scheduler/scheduler_config.json", "text_encoder/config.json", "tokenizer/merges.txt",
            "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json", "tokenizer/vocab.json",
            "unet/config.json", "vae/config.json"]


def test_files_to_fetch_takes_one_safetensors_copy_per_component():
    assert files_to_fetch(SD15_FILES, SD15_INDEX) == sorted(_CONFIGS + [
        "safety_checker/model.safetensors", "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"])
    assert files_to_fetch(SD15_FILES, SD15_INDEX, variant="fp16") == sorted(_CONFIGS + [
        "safety_checker/model.fp16.safetensors", "text_encoder/model.fp16.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.fp16.safetensors"])


def test_files_to_fetch_shards_bin_fallback_and_missing_components():
    files = ["model_index.json", "generation_config.json",
             "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json",
             "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
             "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
             "transformer/diffusion_pytorch_model.safetensors.index.bf16.json",
             "transformer/diffusion_pytorch_model-00001-of-00001.bf16.safetensors",
             "vae/config.json", "vae/diffusion_pytorch_model.bin", "scheduler/scheduler_config.json"]
    index = {"_class_name": "X", "transformer": ["diffusers", "T"], "vae": ["diffusers", "V"],
             "scheduler": ["diffusers", "S"], "text_encoder": [None, None]}
    plain = files_to_fetch(files, index)
    assert "transformer/diffusion_pytorch_model-00002-of-00002.safetensors" in plain
    assert "transformer/diffusion_pytorch_model.safetensors.index.json" in plain
    assert not any("bf16" in f for f in plain)
    assert "vae/diffusion_pytorch_model.bin" in plain  # no safetensors: the .bin is the one copy
    assert "generation_config.json" in plain
    bf16 = files_to_fetch(files, index, variant="bf16")
    assert {f for f in bf16 if f.startswith("transformer/diffusion")} == {
        "transformer/diffusion_pytorch_model.safetensors.index.bf16.json",
        "transformer/diffusion_pytorch_model-00001-of-00001.bf16.safetensors"}
    with pytest.raises(UnsupportedModelError, match="no folder 'unet'"):
        files_to_fetch(files, {**index, "unet": ["diffusers", "U"]})


@pytest.mark.parametrize("text,expected", [
    ("org/name", HubId("org/name")),
    ("stabilityai/stable-diffusion-3-medium-diffusers@main", HubId("stabilityai/stable-diffusion-3-medium-diffusers",
                                                                   "main")),
    (f"org/name@{SHA}", HubId("org/name", SHA)),
    ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
    ("digits", None), ("./org/name", None), ("a/b/c", None), ("/abs/path", None), ("org/", None),
])
def test_parse_hub_id(text, expected):
    assert parse_hub_id(text) == expected


def test_an_existing_folder_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("org/name") is None
    assert resolve_model("org/name") == Path("org/name")


def populate_cache(cache: Path, repo_id: str, folder: Path, sha: str = SHA, refs: tuple[str, ...] = ("main",)) -> Path:
    """Write `folder` into a Hugging Face Hub cache as the library lays it out: content-addressed
    blobs, a snapshot folder of relative symlinks per commit, ``refs/<name>`` holding the commit."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / sha
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(sha)
    return snapshot


def _digit(engine) -> np.ndarray:
    [out] = engine.generate("a handwritten digit 7", SamplingParams(seed=3, num_inference_steps=2, output_type="np"))
    return out.images


def test_engine_serves_a_hub_id_from_the_cache_offline(tmp_path):
    """HF_HUB_OFFLINE=1 (tests/conftest.py): the library resolves the id, a tag and a commit from
    the cache; the engine serves the snapshot under the id's name."""
    cache = tmp_path / "cache"
    snapshot = populate_cache(cache, "diffserve/digits", DIGITS, refs=("main", "v1"))
    for model in ("diffserve/digits", "diffserve/digits@v1", f"diffserve/digits@{SHA}"):
        config = EngineConfig(model=model, download_dir=str(cache))
        assert config.model_path == snapshot
    engine = DiffusionEngine(EngineConfig(model="diffserve/digits", download_dir=str(cache)))
    reference = DiffusionEngine(EngineConfig(model=None))
    try:
        np.testing.assert_array_equal(_digit(engine), _digit(reference))
    finally:
        engine.shutdown()
        reference.shutdown()
    assert served_name("diffserve/digits@v1") == "diffserve/digits"
    with pytest.raises(UnsupportedModelError, match="diffserve/digits@v2 is not in .* HF_HUB_OFFLINE is set"):
        EngineConfig(model="diffserve/digits@v2", download_dir=str(cache)).model_path
    with pytest.raises(UnsupportedModelError, match="nobody/nothing is not in"):
        DiffusionEngine(EngineConfig(model="nobody/nothing", download_dir=str(cache)))


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffserve", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **env},
                          timeout=300)


#: Files a repository may carry beside the folder that the pipeline does not need.
_JUNK = {"digits.ckpt": b"single-file checkpoint", "README.md": b"# card",
         "transformer/diffusion_pytorch_model.bin": b"pickled duplicate",
         "transformer/diffusion_pytorch_model.fp16.safetensors": b"another variant",
         "vae/diffusion_flax_model.msgpack": b"flax", "onnx/vae_decoder/model.onnx": b"onnx"}


def test_download_fetches_only_what_the_pipeline_needs_then_serves_offline(tmp_path):
    hub = FakeHub({"diffserve/digits": repo_from_folder(DIGITS, _JUNK)})
    home = tmp_path / "hf-home"
    try:
        online = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_secret"}
        proc = _cli(["download", "diffserve/digits"], online, tmp_path)
        assert proc.returncode == 0, proc.stderr
        folder = Path(proc.stdout.strip().splitlines()[-1])
        assert folder.parent == home / "hub" / "models--diffserve--digits" / "snapshots"
        expected = {p.relative_to(DIGITS).as_posix() for p in DIGITS.rglob("*") if p.is_file()}
        asked = {path.split("/resolve/", 1)[1].split("/", 1)[1] for _, path, _ in hub.requests if "/resolve/" in path}
        assert asked == expected  # no junk asked for (files of equal content are fetched once: same ETag)
        assert hub.downloaded("diffserve/digits") <= expected
        assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == expected
        assert "Fetching" in proc.stderr  # the library's progress bar
        # the token the library read from the environment, on every request for the repository
        assert {auth for _, path, auth in hub.requests if "diffserve/digits" in path} == {"Bearer hf_secret"}
        # --download-dir: the same, into another cache folder
        other = tmp_path / "other-cache"
        proc = _cli(["download", "diffserve/digits", "--download-dir", str(other)], online, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert Path(proc.stdout.strip().splitlines()[-1]).is_relative_to(other / "models--diffserve--digits")
        for repo, fragment in (("nobody/nothing", "has no repository 'nobody/nothing'"),):
            proc = _cli(["download", repo], online, tmp_path)
            assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        hub.repos["acme/gated"] = repo_from_folder(DIGITS)
        hub.repos["acme/gated"].gated_token = "hf_other"
        proc = _cli(["download", "acme/gated"], online, tmp_path)
        assert proc.returncode == 2 and "is gated" in proc.stderr and "HF_TOKEN" in proc.stderr, proc.stderr
    finally:
        hub.close()
    # the Hub is gone: HF_HUB_OFFLINE=1 (this process, tests/conftest.py) generates from the cache,
    # under the Hub id's name
    from diffserve.entrypoints.cli import main

    out = tmp_path / "out"
    assert main(["generate", "--model", "diffserve/digits", "--download-dir", str(home / "hub"),
                 "a handwritten digit 7", "--steps", "2", "--seed", "1", "-o", str(out)]) == 0
    from PIL import Image

    [png] = sorted(out.glob("*.png"))
    assert json.loads(Image.open(png).text["diffserve"])["model"] == "diffserve/digits"
    # offline, the library checks the snapshot against its cached tree listing: a needed file gone
    # is an incomplete copy (said so), the junk never fetched is not missed
    from diffserve.models.hub import download_model

    assert download_model(HubId("diffserve/digits"), home / "hub") == folder
    (folder / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="is incomplete and HF_HUB_OFFLINE is set"):
        download_model(HubId("diffserve/digits"), home / "hub")


def test_download_refuses_a_local_path(tmp_path):
    proc = _cli(["download", "./somewhere"], {}, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "argument ORG/NAME[@REV]: invalid value './somewhere': must be a Hugging Face Hub id" in proc.stderr


def test_variant_loads_the_components_that_have_it(tmp_path):
    """``variant="fp16"``: a component with ``*.fp16.safetensors`` loads those (here: the
    transformer's weights scaled), the others their variant-less weights."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "digits"
    shutil.copytree(DIGITS, folder)
    weights = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    save_file({k: v * 0.5 for k, v in weights.items()}, folder / "transformer" / "diffusion_pytorch_model.fp16.safetensors")
    plain = DiffusionEngine(EngineConfig(model=str(folder)))
    variant = DiffusionEngine(EngineConfig(model=str(folder), variant="fp16"))
    try:
        assert not np.array_equal(_digit(plain), _digit(variant))
        p = dict(variant.runner.adapter.denoiser.named_parameters())
        name = next(iter(weights))
        torch.testing.assert_close(p[name], weights[name] * 0.5)
    finally:
        plain.shutdown()
        variant.shutdown()
