"""The web playground (``GET /``) in a real headless Chromium, driven by Playwright, against a
real ``diffserve serve`` subprocess on the built-in digits model on localhost; and the API
extensions the page relies on (model card ``capabilities``/``parameters``, the
``stream_progress`` events), checked over plain HTTP on the same server.

Screenshots go to ``artifacts/playground/`` (under ``$DIFFSERVE_ARTIFACTS`` instead of
``artifacts/`` when set). The browser is Debian's ``chromium`` package (``.ci/run`` installs
it); the browser tests are skipped, saying so, only when no Chromium executable can be found.
Playwright never downloads a browser here.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright
from server_helpers import sse_events

REPO = Path(__file__).resolve().parents[3]
ARTIFACTS = Path(os.environ.get("DIFFSERVE_ARTIFACTS", REPO / "artifacts")) / "playground"
MODEL = "diffserve-digits"
PROMPT = "a handwritten digit 5"
API_KEY = "playground-test-key"
#: Chromium executables looked for, in order (``$CHROMIUM`` first when set).
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: Steps of a request that is still running when the test cancels it (~10 ms a step here).
LONG_STEPS = 20_000


def find_chromium() -> str | None:
    """Path of a Chromium executable: ``$CHROMIUM``, else the first of `CHROMIUM_NAMES` on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def serve_supports_api_key() -> bool:
    """Whether ``diffserve serve`` has the ``--api-key`` option (parsed, not run)."""
    from diffserve.entrypoints.cli_args import build_parser

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(["serve", "--api-key", API_KEY])
        except SystemExit:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("browser tests skipped: no Chromium found (looked for $CHROMIUM and "
                    f"{', '.join(CHROMIUM_NAMES)} on PATH); install Debian's: "
                    "apt-get install -y chromium chromium-driver")
    return path


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """``diffserve serve`` on the built-in model (started here, waited for in `server`, so the
    browser starts meanwhile). Two CFG rows per step: a second request waits while one runs.
    With ``--api-key`` when the CLI has it."""
    port = _free_port()
    auth = ["--api-key", API_KEY] if serve_supports_api_key() else []
    log = tmp_path_factory.mktemp("playground_server") / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffserve", "serve", "--port", str(port), "--threads", "1",
             "--max-batch-size", "2", "--max-num-inference-steps", str(LONG_STEPS), "--log-level", "warning", *auth],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    yield SimpleNamespace(proc=proc, log=log, base=f"http://127.0.0.1:{port}", needs_key=bool(auth))
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def browser(chromium_path, server_process):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(server_process):
    """`server_process` once healthy, with ``headers`` (the API key's, when it wants one)."""
    proc, base = server_process.proc, server_process.base
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"diffserve serve exited: {server_process.log.read_text()}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "diffserve serve did not become healthy"
        time.sleep(0.1)
    server_process.headers = {"Authorization": f"Bearer {API_KEY}"} if server_process.needs_key else {}
    return server_process


@pytest.fixture
def page(browser, server):
    """A fresh tab (its own sessionStorage) on the playground; fails the test on a page error
    or on any request to another origin (the page must work offline)."""
    context = browser.new_context(viewport={"width": 1280, "height": 860}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    foreign: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda req: None if req.url.startswith((server.base, "data:", "blob:"))
            else foreign.append(req.url))
    page.goto(server.base + "/")
    if server.needs_key:
        enter_api_key(page)
    expect(page.locator("#generate")).to_be_enabled(timeout=30_000)
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"
    assert not foreign, f"requests to other origins: {foreign}"


def enter_api_key(page: Page) -> None:
    """Answer the API-key dialog: a wrong key first (refused, asked again), then the right one."""
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible(timeout=30_000)
    page.fill("#key-input", "wrong-key")
    page.keyboard.press("Enter")
    expect(page.locator("#key-error")).to_contain_text("did not accept", timeout=10_000)
    page.fill("#key-input", API_KEY)
    page.keyboard.press("Enter")
    expect(dialog).to_be_hidden()
    # the dialog's "close" event (whose handler stores the key) fires in a later task than the hiding
    page.wait_for_function("key => sessionStorage.getItem('diffserve.apiKey') === key", arg=API_KEY, timeout=10_000)
    assert page.evaluate("sessionStorage.getItem('diffserve.apiKey')") == API_KEY


def scrape(server) -> dict[str, float]:
    """``GET /metrics`` as {name{labels}: value}."""
    text = httpx.get(f"{server.base}/metrics", headers=server.headers, timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def blob_bytes(page: Page, src: str) -> bytes:
    """The bytes behind a ``blob:`` URL of the page."""
    b64 = page.evaluate("""async (src) => {
        const blob = await (await fetch(src)).blob();
        return await new Promise((resolve) => {
            const reader = new FileReader();
            reader.onload = () => resolve(reader.result.split(",")[1]);
            reader.readAsDataURL(blob);
        });
    }""", src)
    return base64.b64decode(b64)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


# --------------------------------------------------------------------------------- tests
def test_generate_with_keyboard_shows_result_metadata_download_and_reuse(page, server):
    # Status strip: numbers from /metrics.
    expect(page.locator('[data-metric="running"]')).to_have_text(re.compile(r"^\d+$"), timeout=10_000)
    # Keyboard only: the prompt has focus, a fixed seed via the checkbox, Enter generates.
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.keyboard.type(PROMPT)
    page.focus("#seed-random")
    page.keyboard.press("Space")  # uncheck "random": the seed field before it opens
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Control+A")
    page.keyboard.type("5")
    page.keyboard.press("Enter")  # submits the form

    result = page.locator("#gallery .result")
    expect(result).to_have_count(1, timeout=30_000)
    expect(page.locator("#jobs .job")).to_have_count(0)  # a finished job leaves "In progress"
    expect(page.locator('[data-metric="prompt-cache"]')).to_have_text(re.compile(r"^\d+%$"), timeout=10_000)
    meta = {key: result.locator(f'[data-key="{key}"] dd').inner_text()
            for key in ("prompt", "seed", "num_inference_steps", "guidance_scale", "size", "model", "timings")}
    assert meta["prompt"] == PROMPT and meta["seed"] == "5" and meta["size"] == "8x8" and meta["model"] == MODEL
    assert meta["num_inference_steps"] == "20" and float(meta["guidance_scale"]) == 4.0  # the card's defaults
    assert re.fullmatch(r"\d+\.\d\d s \(queue \d+\.\d\d s, encode \d+\.\d\d s, denoise \d+\.\d\d s, "
                        r"decode \d+\.\d\d s\)", meta["timings"]), meta["timings"]

    # The 8x8 image, enlarged with crisp pixels.
    img = result.locator("img")
    natural, shown, rendering = img.evaluate(
        "i => [[i.naturalWidth, i.naturalHeight], [i.clientWidth, i.clientHeight], getComputedStyle(i).imageRendering]")
    assert natural == [8, 8] and shown[0] >= 64 and shown[0] % 8 == 0 and shown[0] == shown[1]
    assert rendering == "pixelated"
    page.screenshot(path=ARTIFACTS / "generate.png", full_page=True)

    # The same image as the API gives for these settings (the page sent prompt, seed, steps).
    shown_png = blob_bytes(page, img.get_attribute("src"))
    reference = httpx.post(f"{server.base}/v1/images/generations", headers=server.headers, timeout=60, json={
        "prompt": PROMPT, "seed": 5, "num_inference_steps": 20, "guidance_scale": 4.0, "size": "8x8"})
    assert reference.status_code == 200, reference.text
    assert np.abs(pixels(shown_png) - pixels(base64.b64decode(reference.json()["data"][0]["b64_json"]))).max() <= 1

    # Download: the same PNG, named by its seed.
    with page.expect_download() as download_info:
        result.locator("a.download").click()
    download = download_info.value
    assert download.suggested_filename == "diffserve-5.png"
    download.save_as(ARTIFACTS / download.suggested_filename)
    assert (ARTIFACTS / download.suggested_filename).read_bytes() == shown_png

    # Click to reuse the settings (keyboard: the image is a button).
    page.fill("#prompt", "something else")
    page.check("#seed-random")
    result.locator("button.thumb").focus()
    page.keyboard.press("Enter")
    assert page.input_value("#prompt") == PROMPT and page.input_value("#seed") == "5"
    assert page.input_value("#n") == "1" and not page.is_checked("#seed-random")
    assert page.evaluate("document.activeElement.id") == "prompt"

    # Phone width: one column, nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    page.screenshot(path=ARTIFACTS / "phone.png", full_page=True)


def test_sampler_from_the_card_reaches_the_server_and_the_download_carries_it(page, server):
    """The model card's ``scheduler`` enum becomes a select; the chosen sampler goes into the
    request, the image equals the API's for it, and the downloaded PNG carries it (A1111 text)."""
    from diffserve.media.metadata import read_image_metadata

    select = page.locator("#param-scheduler")
    expect(select).to_be_visible()
    options = select.locator("option").evaluate_all("options => options.map(o => o.value)")
    assert options == ["", "euler", "dpmpp_2m", "unipc"]  # "": the model's own; a flow model's samplers
    page.fill("#prompt", PROMPT)
    page.uncheck("#seed-random")
    page.fill("#seed", "8")
    select.select_option("dpmpp_2m")
    page.click("#generate")
    result = page.locator("#gallery .result")
    expect(result).to_have_count(1, timeout=30_000)
    shown = blob_bytes(page, result.locator("img").get_attribute("src"))
    reference = httpx.post(f"{server.base}/v1/images/generations", headers=server.headers, timeout=60, json={
        "prompt": PROMPT, "seed": 8, "num_inference_steps": 20, "guidance_scale": 4.0, "size": "8x8",
        "scheduler": "dpmpp_2m"})
    assert reference.status_code == 200, reference.text
    assert np.abs(pixels(shown) - pixels(base64.b64decode(reference.json()["data"][0]["b64_json"]))).max() <= 1
    with page.expect_download() as download_info:
        result.locator("a.download").click()
    path = ARTIFACTS / "sampler-download.png"
    download_info.value.save_as(path)
    meta = read_image_metadata(path.read_bytes())
    assert meta["diffserve"]["scheduler"] == "dpmpp_2m" and meta["diffserve"]["seed"] == 8
    assert "Sampler: DPM++ 2M" in meta["parameters"]
    # reusing the result's settings selects its sampler again
    select.select_option("")
    result.locator("button.thumb").click()
    assert page.input_value("#param-scheduler") == "dpmpp_2m"


def test_concurrent_requests_show_queue_place_and_cancel_aborts_on_server(page, server):
    before = scrape(server)
    # A long request takes the engine's two rows (CFG); the next one waits behind it.
    page.fill("#prompt", "a handwritten digit 1")
    page.fill("#num_inference_steps", str(LONG_STEPS))
    page.click("#generate")
    long_job = page.locator(".job", has_text="digit 1")
    expect(long_job.locator(".slot")).to_have_attribute("data-state", "running", timeout=30_000)
    expect(long_job.locator(".state")).to_contain_text(f"/ {LONG_STEPS}")

    page.fill("#prompt", "a handwritten digit 2")
    page.fill("#num_inference_steps", "10")
    page.click("#generate")
    queued_job = page.locator(".job", has_text="digit 2")
    expect(queued_job.locator(".slot")).to_have_attribute("data-state", "queued", timeout=30_000)
    expect(queued_job.locator(".state")).to_have_text("queued: place 1")
    expect(page.locator('[data-metric="waiting"]')).to_have_text("1", timeout=10_000)
    page.screenshot(path=ARTIFACTS / "queue.png", full_page=True)

    # Cancel closes the stream: the server aborts the engine request and counts a 499.
    long_job.locator("button.cancel").click()
    expect(long_job).to_have_attribute("data-state", "cancelled", timeout=10_000)
    deadline = time.monotonic() + 20
    while True:
        after = scrape(server)
        aborted = after['diffserve_engine_requests_total{outcome="aborted"}'] - \
            before['diffserve_engine_requests_total{outcome="aborted"}']
        closed = after.get('diffserve_requests_total{status="499"}', 0) - \
            before.get('diffserve_requests_total{status="499"}', 0)
        if aborted == 1 and closed == 1:
            break
        assert time.monotonic() < deadline, f"the server did not abort the cancelled request: {after}"
        time.sleep(0.1)

    # The waiting request runs now and lands in the gallery.
    expect(page.locator("#gallery .result", has_text="digit 2")).to_have_count(1, timeout=30_000)
    assert scrape(server)["diffserve_num_requests_running"] == 0
    # Dismiss the cancelled job with the keyboard.
    dismiss = long_job.locator("button.cancel")
    expect(dismiss).to_have_text("Dismiss")
    dismiss.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#jobs .job")).to_have_count(0)


def test_edit_uploads_an_image(page, server, tmp_path):
    models = httpx.get(f"{server.base}/v1/models", headers=server.headers, timeout=10).json()["data"]
    if "image-edit" not in (models[0].get("capabilities") or []):
        pytest.skip("edit step skipped: GET /v1/models lists no 'image-edit' capability for "
                    f"{models[0]['id']!r} (POST /v1/images/edits is not served for it yet)")
    source = tmp_path / "seven.png"
    made = httpx.post(f"{server.base}/v1/images/generations", headers=server.headers, timeout=60,
                      json={"prompt": "a handwritten digit 7", "seed": 1, "num_inference_steps": 10})
    assert made.status_code == 200, made.text
    source.write_bytes(base64.b64decode(made.json()["data"][0]["b64_json"]))

    page.locator('#modes input[value="image-edit"]').check()
    expect(page.locator("#image")).to_be_visible()
    page.set_input_files("#image", str(source))
    page.fill("#prompt", "a handwritten digit 1")
    page.fill("#num_inference_steps", "10")
    page.click("#generate")
    result = page.locator("#gallery .result")
    expect(result).to_have_count(1, timeout=30_000)
    assert result.locator('[data-key="prompt"] dd').inner_text() == "a handwritten digit 1"
    assert result.locator("img").evaluate("i => i.naturalWidth") == 8
    page.screenshot(path=ARTIFACTS / "edit.png", full_page=True)


# ------------------------------------------------------------- API extensions the page uses
def test_model_card_lists_capabilities_and_parameters(server):
    card = httpx.get(f"{server.base}/v1/models/{MODEL}", headers=server.headers, timeout=10).json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["capabilities"] == ["text-to-image", "image-edit"]  # SD3: text-to-image and img2img
    assert card["step_batching"] is True
    p = card["parameters"]
    assert set(p) == {"negative_prompt", "n", "size", "num_inference_steps", "guidance_scale", "seed",
                      "partial_images", "strength", "loras", "scheduler", "clip_skip"}  # SD3: CLIP, flow samplers
    assert p["scheduler"]["enum"] == ["euler", "dpmpp_2m", "unipc"] and "eta" not in p  # eta: DDIM only
    assert p["loras"]["type"] == "object"  # the playground shows it as a text field (JSON)
    assert [(e["name"], e["origin"]) for e in card["loras"]] == [("mirror", "builtin")]  # the digits model's own
    assert p["strength"]["capabilities"] == ["image-edit"] and p["strength"]["default"] == 0.6
    assert "true_cfg_scale" not in p  # SD3 has CFG only
    assert {k: p["num_inference_steps"][k] for k in ("type", "default", "minimum", "maximum")} == {
        "type": "integer", "default": 20, "minimum": 1, "maximum": LONG_STEPS}  # model default, --max-num-... limit
    assert p["guidance_scale"]["default"] == 4.0 and p["guidance_scale"]["type"] == "number"
    size = p["size"]
    assert size["default"] == "8x8" and size["max_width"] == size["max_height"] == 8 and 8 % size["multiple_of"] == 0
    assert p["n"]["maximum"] == 10 and p["n"]["capabilities"] == ["text-to-image", "image-edit"]
    assert "default" not in p["seed"]  # random when omitted; absent fields are left out of the JSON
    listed = httpx.get(f"{server.base}/v1/models", headers=server.headers, timeout=10).json()["data"]
    assert listed == [card]


def test_stream_progress_reports_queue_places_then_every_step(server):
    url = f"{server.base}/v1/images/generations"
    long = {"prompt": "a handwritten digit 1", "num_inference_steps": LONG_STEPS, "stream": True,
            "stream_progress": True}
    body = {"prompt": "a handwritten digit 2", "num_inference_steps": 3, "n": 2, "seed": 4, "stream": True,
            "stream_progress": True, "partial_images": 1}
    with httpx.Client(headers=server.headers, timeout=30) as client:
        with client.stream("POST", url, json=long) as running:
            # Alone, it may still show as first in the queue until the engine's loop admits it.
            events = (item for item in sse_events(running) if item[0] != "diffserve.queued")
            assert next(events) == ("diffserve.progress", {"type": "diffserve.progress", "image_index": 0, "step": 0,
                                                           "num_inference_steps": LONG_STEPS})
            assert next(events)[1]["step"] == 1
            with client.stream("POST", url, json=body) as waiting:
                waiting_events = sse_events(waiting)
                # Both images wait behind the long request, image 1 behind image 0.
                assert [next(waiting_events) for _ in range(2)] == [
                    ("diffserve.queued", {"type": "diffserve.queued", "image_index": i, "queue_position": i + 1})
                    for i in range(2)]
                running.close()  # cancels the long request: the waiting images move up and run
                rest = list(waiting_events)
    for index in range(2):
        mine = [(name, data) for name, data in rest if data.get("image_index") == index]
        places = [data["queue_position"] for name, data in mine if name == "diffserve.queued"]
        assert places == sorted(places, reverse=True) and all(p < index + 1 for p in places)  # only moves up
        mine = [(name, data) for name, data in mine if name != "diffserve.queued"]
        names = [name for name, _ in mine]
        # the preview of step 2 is decoded beside the next step: after step 2's progress, before
        # the completed image (maybe after step 3's progress)
        assert names[:3] == ["diffserve.progress"] * 3 and names[-1] == "image_generation.completed"
        assert sorted(names[3:5]) == ["diffserve.progress", "image_generation.partial_image"]
        assert [data["step"] for name, data in mine if name == "diffserve.progress"] == [0, 1, 2, 3]
        assert mine[-1][1]["seed"] == 4 + index
    # Without stream_progress the stream holds OpenAI's events only.
    with httpx.stream("POST", url, headers=server.headers, timeout=30,
                      json={**body, "stream_progress": False}) as plain:
        names = [name for name, _ in sse_events(plain)]
    assert sorted(names) == ["image_generation.completed"] * 2 + ["image_generation.partial_image"] * 2
