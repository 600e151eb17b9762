"""Shared fixtures: tiny random-weight pipeline folders built offline (the registry's,
``tests/tiny_models/registry.py``, each built once per session), and one engine on the tiny SD3
folder."""

from __future__ import annotations

import concurrent.futures.thread
import os
import sys
import threading
import time
import traceback
from pathlib import Path

# Nothing in the tests reaches the Hugging Face Hub (no weights are downloaded at test time): set
# before huggingface_hub is first imported (it reads the variable then), and inherited by every
# subprocess the tests start.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
#: benchmarks/ is not a package: tests import its scripts (``quality``, ``quality_video``, ...) as modules.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from tiny_models import build_tiny_glm_image, build_tiny_sd3  # noqa: E402
from tiny_models.registry import BY_ID  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread():
    """Run the test with ``torch.set_num_threads(1)`` and restore the previous count afterwards
    (for tests whose code under test sets its own thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def always_group(monkeypatch):
    """Length groups for every mixed-size forward: the tiny folders' forwards pad fewer token
    slots than `length_groups.MIN_PADDED_TOKENS_PER_CALL`, so tests of the grouped path lower it."""
    from diffserve.pipelines import length_groups

    monkeypatch.setattr(length_groups, "MIN_PADDED_TOKENS_PER_CALL", 0)


@pytest.fixture
def fresh_dynamo():
    """Reset torch.compile's caches before and after the test: a compile test then compiles its
    own graphs (dynamo reuses code compiled for another engine on the same block classes, so
    ``graphs_compiled`` would read 0) and leaves none behind for the next one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """``tiny_folder(model_id) -> Path``: the folder of a registry model
    (``tests/tiny_models/registry.py``), built on first use and shared by the whole session."""
    built: dict[str, Path] = {}

    def get(model_id: str) -> Path:
        if model_id not in built:
            model = BY_ID[model_id]
            root = None if model.builtin else tmp_path_factory.mktemp(model_id.replace(".", "_"))
            built[model_id] = model.folder(root)
        return built[model_id]

    return get


@pytest.fixture(scope="session")
def tiny_sd3_dir(tiny_folder) -> Path:
    """A tiny SD3 folder without T5 (CLIP x2), 64x64 default, resolution factor 16."""
    return tiny_folder("StableDiffusion3Pipeline")


@pytest.fixture(scope="session")
def tiny_glm_image_dir(tmp_path_factory) -> Path:
    """A tiny GLM-Image folder (AR stage writing 32-code prior tokens + DiT); sizes 32 x k."""
    return build_tiny_glm_image(tmp_path_factory.mktemp("tiny_glm_image"))


@pytest.fixture(scope="session")
def tiny_sd3_t5_dir(tmp_path_factory) -> Path:
    """A tiny SD3 folder with a T5 encoder and a short CLIP limit (16 tokens)."""
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_t5"), with_t5=True, clip_max_length=16)


@pytest.fixture(scope="session")
def sync_engine(tiny_sd3_dir, engine):
    """The shared engine's runner behind an engine without the encode/decode side thread
    (``overlap_stages=False``): every step() prepares, steps and decodes inline, so tests can
    assert exact interleavings. The request scheduler's join wait is off (it depends on measured
    prepare and step times); a test that checks it sets ``scheduler.join_wait_fraction``."""
    from diffserve import DiffusionEngine, EngineConfig

    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_batch_size=16, overlap_stages=False),
                          runner=engine.runner)
    eng.scheduler.join_wait_fraction = 0.0
    yield eng
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="session")
def tiny_flux_dir(tiny_folder) -> Path:
    """A tiny FLUX.1-schnell-like folder (``FluxPipeline``, no guidance embedding, shift 1)."""
    return tiny_folder("FluxPipeline-schnell")


@pytest.fixture(scope="session")
def tiny_flux_dev_dir(tiny_folder) -> Path:
    """A tiny FLUX.1-dev-like folder (``FluxPipeline``, guidance embedding, dynamic shifting)."""
    return tiny_folder("FluxPipeline-dev")


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tiny_folder) -> Path:
    """A tiny ``FluxKontextPipeline`` folder (Flux-dev components)."""
    return tiny_folder("FluxKontextPipeline")


@pytest.fixture(scope="session")
def tiny_sd15_dir(tiny_folder) -> Path:
    """A tiny SD 1.5-layout ``StableDiffusionPipeline`` folder (PNDM, epsilon), 64x64 default."""
    return tiny_folder("StableDiffusionPipeline")


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tiny_folder) -> Path:
    """A tiny SDXL-base-layout ``StableDiffusionXLPipeline`` folder, 64x64 default."""
    return tiny_folder("StableDiffusionXLPipeline")


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tiny_folder) -> Path:
    """A tiny ``QwenImagePipeline`` folder (Qwen2.5-VL text encoder, Qwen-Image VAE)."""
    return tiny_folder("QwenImagePipeline")


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_dir(tiny_folder) -> Path:
    """A tiny ``QwenImageEditPipeline`` folder; load it with
    ``from_pretrained(dir, processor=tiny_models.load_qwen2vl_processor(dir / "processor"))``."""
    return tiny_folder("QwenImageEditPipeline")


@pytest.fixture(scope="session")
def tiny_wan_dir(tiny_folder) -> Path:
    """A tiny Wan 2.1 T2V ``WanPipeline`` folder (4x temporal, 8x spatial VAE)."""
    return tiny_folder("WanPipeline-2.1")


@pytest.fixture(scope="session")
def tiny_wan22_dir(tiny_folder) -> Path:
    """A tiny Wan 2.2 two-expert ``WanPipeline`` folder (``transformer_2``, ``boundary_ratio`` 0.875)."""
    return tiny_folder("WanPipeline-2.2")


@pytest.fixture(scope="session")
def engine(tiny_sd3_dir):
    """A step-mode engine on the tiny SD3 folder (shared: tests must leave it idle)."""
    from diffserve import DiffusionEngine, EngineConfig

    eng = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_batch_size=16))
    yield eng
    assert not eng.has_unfinished_requests()



def _fail_on_leftover_threads() -> None:
    """Fail the run, instead of hanging it, when a test left a non-daemon thread running: the
    interpreter would wait for it forever after the summary (a CI run once timed out so).
    Prints each such thread's name and stack, then exits with status 1. Runs at interpreter
    exit just before non-daemon threads are joined. Thread-pool workers are left out: the
    exit handler of `concurrent.futures` (which runs after this one) stops them."""
    pool_workers = concurrent.futures.thread._threads_queues
    deadline = time.monotonic() + 20  # threads that are stopping get this long
    while True:
        left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
                and t.is_alive() and t not in pool_workers]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        frames = sys._current_frames()
        for thread in left:
            print(f"\nconftest: a test left the non-daemon thread {thread.name!r} running:", file=sys.stderr)
            traceback.print_stack(frames.get(thread.ident), file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


# the hook `concurrent.futures` uses: it runs before the interpreter joins non-daemon threads
threading._register_atexit(_fail_on_leftover_threads)
