"""The README's schemathesis command (``--checks all --seed 3``) in CI form: a bounded run (a
few examples per operation, the server's request limits small so every generated request is
quick) against the real server on the built-in image model (generations and edits) and video
model (video jobs and streams). Every check passes: the served schema states what the server
enforces, and the server answers only what the schema documents."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffserve import AsyncDiffusionEngine, EngineConfig
from diffserve.entrypoints.openai.app import create_app
from server_helpers import serve

ROOT = Path(__file__).resolve().parents[3]
#: schemathesis' command line, run in a subprocess (its console script's entry point) from the
#: repository root, whose schemathesis.toml loads tests/openapi_fuzz_hooks.py (valid image uploads).
SCHEMATHESIS = "import sys; from schemathesis.cli import schemathesis; sys.argv[0] = 'schemathesis'; schemathesis()"
#: Small limits, stated in the served schema, so the fuzzer's largest requests stay quick.
LIMITS = dict(max_num_inference_steps=2, max_num_images_per_prompt=2, max_num_frames=9, max_num_chunks=2,
              max_pixels=32 * 32)


#: The phases run per model: all of them on the image model; the video model's stateful phase
#: (sequences of linked calls) takes ~10 minutes of the fuzzer's own CPU on 2 loaded cores, too
#: long for CI (the README's command runs it).
PHASES = {"digits": "examples,coverage,fuzzing,stateful", "digits-video": "examples,coverage,fuzzing"}


@pytest.mark.parametrize("model", ["digits", "digits-video"])
def test_schemathesis_finds_no_failure(model):
    engine = AsyncDiffusionEngine(EngineConfig(model=model, num_threads=1, **LIMITS))
    with serve(create_app(engine, f"diffserve-{model}")) as base:
        run = subprocess.run(
            [sys.executable, "-c", SCHEMATHESIS, "run", f"{base}/openapi.json", "--checks", "all", "-n", "5",
             "--seed", "3", "--phases", PHASES[model], "--request-timeout", "20", "--generation-database", "none", "--no-color"],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    # every generated case passed (warnings, e.g. ids no call supplies, end the summary line)
    assert re.search(r"(\d+) generated, \1 passed", run.stdout), run.stdout[-3000:]
