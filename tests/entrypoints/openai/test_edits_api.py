"""``POST /v1/images/edits`` on the built-in digits model (SD3 image-to-image), run for real
(uvicorn on a free localhost port, in a thread) and driven by the official ``openai`` client
(``client.images.edit``) and raw multipart requests; the unsupported OpenAI endpoints."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from diffserve import AsyncDiffusionEngine, DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.openai.app import create_app
from diffserve.media.image_encoding import encode_image
from diffserve.entrypoints.openai.unsupported_routes import UNSUPPORTED_ENDPOINTS
from diffserve.core.inputs import MAX_IMAGE_FILE_BYTES, MAX_INPUT_PIXELS, read_image
from server_helpers import assert_openai_error, serve

torch.set_num_threads(1)

MODEL = "diffserve-digits"
EIGHT = "the number eight"


def encoded(array: np.ndarray, fmt: str = "PNG", mode: str = "L", **save) -> bytes:
    """A float (H, W) image in [0, 1] as an image file."""
    image = Image.fromarray((np.asarray(array) * 255).round().astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def pixels(b64: str) -> np.ndarray:
    """A grey image of a response as float (H, W) in [0, 1]."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("L"), dtype=np.float64) / 255


def threes(count: int) -> np.ndarray:
    from quality_img2img import source_images

    return source_images(3, count)


@pytest.fixture(scope="module")
def server():
    engine = AsyncDiffusionEngine(EngineConfig(num_threads=1))
    with serve(create_app(engine, MODEL)) as base:
        yield SimpleNamespace(base=base, engine=engine, url=f"{base}/v1/images/edits",
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0))


@pytest.fixture(scope="module")
def judge():
    from quality import build_judge

    return build_judge()[0]


def post_edit(server, files, data=None, **kwargs) -> httpx.Response:
    return httpx.post(server.url, files=files, data={"prompt": EIGHT, **(data or {})}, timeout=60, **kwargs)


# -------------------------------------------------------------------------- openai client
def test_openai_client_edit_turns_a_three_into_an_eight(server, judge):
    from quality import judge_images

    sources = threes(4)
    assert list(judge_images(judge, sources)) == [3, 3, 3, 3]  # the inputs are 3s
    outputs = []
    for i, source in enumerate(sources):
        resp = server.client.images.edit(image=("three.png", encoded(source), "image/png"), prompt=EIGHT, n=2,
                                         extra_body={"strength": 0.9, "seed": 10 * i})
        assert resp.size == "8x8" and [d.seed for d in resp.data] == [10 * i, 10 * i + 1]  # size auto: the input's
        outputs += [pixels(d.b64_json) for d in resp.data]
    judged = judge_images(judge, np.stack(outputs))
    assert np.mean(judged == 8) >= 0.75, judged


def test_openai_client_streams_edit_events(server):
    source = encoded(threes(1)[0])
    stream = server.client.images.edit(image=("three.png", source, "image/png"), prompt=EIGHT, stream=True,
                                       partial_images=2, extra_body={"strength": 0.9, "seed": 4,
                                                                     "num_inference_steps": 10})
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert events[-1].size == "8x8" and Image.open(io.BytesIO(base64.b64decode(events[-1].b64_json))).size == (8, 8)
    # stream_progress adds diffserve's step events (strength 0.9 x 10 steps = 9 steps run)
    with httpx.stream("POST", server.url, files={"image": ("three.png", source, "image/png")}, timeout=60,
                      data={"prompt": EIGHT, "strength": "0.9", "num_inference_steps": "10", "stream": "true",
                            "stream_progress": "true"}) as resp:
        assert resp.status_code == 200
        names = [line[len("event: "):] for line in resp.iter_lines() if line.startswith("event: ")]
    # (a diffserve.queued may come first, until the engine's loop admits the request)
    assert [n for n in names if n != "diffserve.queued"] == ["diffserve.progress"] * 10 + ["image_edit.completed"]


def test_streamed_edit_counts_the_steps_strength_runs(server):
    """strength 0.3 of 20 steps runs 6: every progress event says 6, and the 3 previews are
    spread over those 6 steps (not over 20, which would leave most of them unsent)."""
    source = encoded(threes(1)[0])
    with httpx.stream("POST", server.url, files={"image": ("three.png", source, "image/png")}, timeout=60,
                      data={"prompt": EIGHT, "strength": "0.3", "num_inference_steps": "20", "stream": "true",
                            "stream_progress": "true", "partial_images": "3", "seed": "1"}) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if e["type"] == "diffserve.progress"]
    assert [e["num_inference_steps"] for e in progress] == [6] * 7 and [e["step"] for e in progress] == list(range(7))
    assert [e["type"] for e in events].count("image_edit.partial_image") == 3
    assert events[-1]["type"] == "image_edit.completed"


def test_same_seed_is_byte_identical_over_http_and_offline(server):
    source = encoded(threes(2)[1])
    params = {"strength": 0.7, "seed": 123, "num_inference_steps": 12, "guidance_scale": 3.0}
    first, second = (server.client.images.edit(image=("three.png", source, "image/png"), prompt=EIGHT,
                                               extra_body=params) for _ in range(2))
    assert first.data[0].b64_json == second.data[0].b64_json
    offline = DiffusionEngine(EngineConfig(num_threads=1))
    [out] = offline.generate(EIGHT, SamplingParams(**params), inputs=read_image(source, "image"))
    assert out.ok
    # the same pixels, byte for byte (the HTTP PNG also carries its generation metadata)
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(first.data[0].b64_json))))
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encode_image(out.images[0], "png", None)))), served)


@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("JPEG", {"quality": 95}), ("WEBP", {"lossless": True})])
def test_png_jpeg_and_webp_inputs_and_url_responses(server, fmt, options):
    data = encoded(threes(1)[0], fmt, "RGB", **options)
    resp = server.client.images.edit(image=(f"three.{fmt.lower()}", data, f"image/{fmt.lower()}"), prompt=EIGHT,
                                     response_format="url", output_format="webp",
                                     extra_body={"seed": 1, "num_inference_steps": 4, "strength": 0.5})
    fetched = httpx.get(resp.data[0].url)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(fetched.content)).size == (8, 8) and resp.data[0].expires_at is not None


def test_size_auto_is_the_input_size_within_the_model_limits(server):
    wide = np.zeros((6, 8), dtype=np.float32)  # 8 wide, 6 high: multiples of the model's factor (2)
    resp = post_edit(server, {"image": ("wide.png", encoded(wide), "image/png")}, {"num_inference_steps": "2"})
    assert resp.status_code == 200 and resp.json()["size"] == "8x6"
    big = np.zeros((13, 32), dtype=np.float32)  # over the model's 8 px: scaled down, aspect kept, rounded
    resp = post_edit(server, {"image": ("big.png", encoded(big), "image/png")}, {"num_inference_steps": "2"})
    assert resp.status_code == 200 and resp.json()["size"] == "8x4"
    assert pixels(resp.json()["data"][0]["b64_json"]).shape == (4, 8)
    resp = post_edit(server, {"image": ("big.png", encoded(big), "image/png")},
                     {"num_inference_steps": "2", "size": "4x8"})  # an explicit size wins
    assert resp.status_code == 200 and resp.json()["size"] == "4x8"


def test_file_parts_without_a_filename_and_the_form_schema(server):
    png = encoded(threes(1)[0])
    resp = post_edit(server, {"image": (None, png)}, {"num_inference_steps": "2", "seed": "1"})  # no filename
    named = post_edit(server, {"image": ("x.png", png, "image/png")}, {"num_inference_steps": "2", "seed": "1"})
    assert resp.status_code == 200 and resp.json()["data"][0]["b64_json"] == named.json()["data"][0]["b64_json"]
    schema = httpx.get(server.base + "/openapi.json").json()["paths"]["/v1/images/edits"]["post"]
    form = schema["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["image", "prompt"] and "strength" in form["properties"]
    assert not any(b.get("type") == "null" for p in form["properties"].values() for b in p.get("anyOf", [p]))


# -------------------------------------------------------------------------------- errors
def test_image_errors_name_the_field(server):
    good = encoded(threes(1)[0])
    gif = io.BytesIO()
    Image.new("L", (8, 8)).save(gif, format="GIF")
    huge = io.BytesIO()
    Image.new("1", (4097, 4097)).save(huge, format="PNG")  # small file, too many pixels
    cases = [
        ({"image": ("x.png", b"not an image", "image/png")}, "image", "unreadable"),
        ({"image": ("x.png", good[: len(good) // 2], "image/png")}, "image", "unreadable"),
        ({"image": ("x.gif", gif.getvalue(), "image/gif")}, "image", "a PNG, JPEG or WebP image"),
        ({"image": ("x.png", huge.getvalue(), "image/png")}, "image", f"at most {MAX_INPUT_PIXELS} pixels"),
        ({"image": ("x.png", good, "image/png"), "mask": ("m.png", encoded(np.ones((4, 4))), "image/png")},
         "mask", "the image's size 8x8"),
        ({"image": ("x.png", good, "image/png"), "mask": ("m.png", encoded(np.ones((8, 8))), "image/png")},
         "mask", "does not inpaint"),  # SD3 image-to-image takes no mask
        ([("image[]", ("a.png", good, "image/png")), ("image[]", ("b.png", good, "image/png"))], "image",
         "one input image"),  # two images reach the model, which takes one
        ({}, "image", "Missing required parameter"),
    ]
    for files, param, fragment in cases:
        if files:
            resp = post_edit(server, files)
        else:  # a form with no file part (httpx would send a urlencoded body without files)
            resp = httpx.post(server.url, files={"prompt": (None, EIGHT)}, timeout=60)
        assert_openai_error(resp, 400, param=param)
        assert fragment in resp.json()["error"]["message"], resp.json()
    too_big = b"\x89PNG" + bytes(MAX_IMAGE_FILE_BYTES)
    resp = post_edit(server, {"image": ("x.png", too_big, "image/png")})
    assert_openai_error(resp, 400, param="image")
    assert f"at most {MAX_IMAGE_FILE_BYTES} bytes" in resp.json()["error"]["message"]


def test_form_field_errors(server):
    image = {"image": ("x.png", encoded(threes(1)[0]), "image/png")}
    for data, param in [({"n": "two"}, "n"), ({"strength": "0"}, "strength"), ({"strength": "1.5"}, "strength"),
                        ({"size": "7x8"}, "size"), ({"bogus": "1"}, "bogus"), ({"markup": "x"}, "markup"),
                        ({"seed": "-1"}, "seed"), ({"background": "transparent"}, "background"),
                        ({"model": "other"}, "model")]:
        resp = post_edit(server, image, data)
        assert_openai_error(resp, 404 if param == "model" else 400, param=param)
    resp = httpx.post(server.url, files={**image, "prompt": (None, "a"), "n": (None, "1")},
                      data={"n": "2"}, timeout=60)  # the same field twice
    assert_openai_error(resp, 400, param="n")
    resp = httpx.post(server.url, json={"prompt": EIGHT}, timeout=60)
    assert_openai_error(resp, 415, code="unsupported_media_type")


def test_cross_site_form_posts_are_refused(server):
    image = {"image": ("x.png", encoded(threes(1)[0]), "image/png")}
    resp = post_edit(server, image, {"num_inference_steps": "2"}, headers={"Origin": "https://evil.example"})
    assert_openai_error(resp, 403, code="cross_origin_forbidden")
    same = server.base  # the playground's own origin
    assert post_edit(server, image, {"num_inference_steps": "2"}, headers={"Origin": same}).status_code == 200


def test_models_without_image_inputs_refuse_edits(tiny_flux_dir):
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_flux_dir), num_threads=1))
    with serve(create_app(engine, "flux")) as base:
        resp = httpx.post(f"{base}/v1/images/edits", files={"image": ("x.png", encoded(np.zeros((16, 16))), "image/png")},
                          data={"prompt": "a cat"}, timeout=60)
        assert_openai_error(resp, 404, code="unsupported_endpoint")  # not served, nor in the schema
        assert "takes no input images" in resp.json()["error"]["message"]
        assert "/v1/images/edits" not in httpx.get(f"{base}/openapi.json").json()["paths"]
        card = httpx.get(f"{base}/v1/models/flux").json()
        assert card["capabilities"] == ["text-to-image"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks variations deprecated
def test_unsupported_endpoints_answer_an_openai_404(server):
    for path in UNSUPPORTED_ENDPOINTS:
        path = path.replace("{rest:path}", "transcriptions")
        for method in ("GET", "POST"):
            resp = httpx.request(method, server.base + path, json={"model": "x"}, timeout=10)
            assert_openai_error(resp, 404, code="unsupported_endpoint")
            assert "does not serve" in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="chat completions"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="image variations"):
        server.client.images.create_variation(image=("x.png", encoded(np.zeros((8, 8))), "image/png"))
    assert json.loads(httpx.get(server.base + "/v1/nothing-here").text)["error"]["code"] == "not_found"
    # an image model serves no video jobs: 404 on every /v1/videos route, saying so
    for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", "/v1/videos/video_x"),
                         ("DELETE", "/v1/videos/video_x"), ("POST", "/v1/videos/streams")):
        resp = httpx.request(method, server.base + path, json={"prompt": "a digit"}, timeout=10)
        assert_openai_error(resp, 404, code="unsupported_endpoint")
        assert "generates images" in resp.json()["error"]["message"] or "stream" in resp.json()["error"]["message"]
    paths = httpx.get(server.base + "/openapi.json").json()["paths"]
    assert not any(path.startswith("/v1/videos") for path in paths), sorted(paths)  # nor streams
