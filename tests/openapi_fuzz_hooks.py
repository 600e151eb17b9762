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


def _tolerate_binary_files() -> None:
    """Work around schemathesis 4.32.5 validating a drawn array of uploaded files (``image[]``,
    our `image_files` as its ``Binary`` values) with jsonschema-rs, which raises "Unsupported
    type: 'Binary'" and ends the run with a runtime error (``generation/jsonschema/strategy.py``:
    the array-parts check). Elsewhere schemathesis validates such bodies with the files replaced
    by "" (``negative._strip_binary``: ``format: binary`` is annotation-only); this does the same
    in that check."""
    from schemathesis.generation.jsonschema import strategy
    from schemathesis.specs.openapi.negative import _strip_binary

    validator = strategy._validator

    def binary_tolerant(schema):
        is_valid = validator(schema)
        return lambda value: is_valid(_strip_binary(value))

    strategy._validator = binary_tolerant


_tolerate_binary_files()
