"""schemathesis hooks for fuzzing diffserve's OpenAPI schema (loaded by the repository's
``schemathesis.toml``): schema-valid file uploads (``format: binary``, the edits' ``image``)
are image files the server can decode, PNG, JPEG or WebP, instead of arbitrary bytes. What a
file's bytes must be is the one rule of the server JSON Schema cannot state, so this fills it
in for the generator; negative tests still send non-files. Sizes 16-64 pixels per side: what
every served model takes as a reference (Flux Kontext needs 16x16 at least)."""

from __future__ import annotations

import io

import schemathesis
from hypothesis import strategies as st
from PIL import Image


@st.composite
def image_files(draw) -> bytes:
    """An encoded RGB image of one flat colour: PNG, JPEG or WebP, 16-64 pixels per side."""
    size = (draw(st.integers(16, 64)), draw(st.integers(16, 64)))
    colour = tuple(draw(st.integers(0, 255)) for _ in range(3))
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=draw(st.sampled_from(["PNG", "JPEG", "WEBP"])))
    return out.getvalue()


schemathesis.openapi.format("binary", image_files())
