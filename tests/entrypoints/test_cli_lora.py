"""``diffserve generate --lora PATH[:SCALE]`` (files, folders, the built-in model's own adapters)
and the LoRA flags' one-line usage errors."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from diffserve.entrypoints.cli import main
from diffserve.entrypoints.cli_args import parse_lora_use
from diffserve.entrypoints.engine_args import lora_loads
from diffserve.core.errors import InvalidRequestError

FAST = ["--steps", "2", "--threads", "1", "--seed", "5"]


def test_builtin_mirror_and_a_file(tmp_path, capsys):
    assert main(["generate", "a handwritten digit 3", "--lora", "mirror", *FAST, "-o", str(tmp_path / "m")]) == 0
    assert main(["generate", "a handwritten digit 3", *FAST, "-o", str(tmp_path / "plain")]) == 0
    styled = Image.open(tmp_path / "m" / "0001_seed5.png")
    plain = Image.open(tmp_path / "plain" / "0001_seed5.png")
    assert styled.tobytes() != plain.tobytes()
    meta = json.loads(styled.text["diffserve"])
    assert meta["loras"] == {"mirror": 1.0} and "<lora:mirror:1>" in styled.text["parameters"]
    folder = tmp_path / "copy"
    folder.mkdir()
    from diffserve.models import BUILTIN_LORAS

    (folder / "flip.safetensors").write_bytes(
        (BUILTIN_LORAS["digits"]["mirror"] / "pytorch_lora_weights.safetensors").read_bytes())
    assert main(["generate", "a handwritten digit 3", "--lora", f"{folder / 'flip.safetensors'}:1", *FAST,
                 "-o", str(tmp_path / "f")]) == 0
    assert Image.open(tmp_path / "f" / "0001_seed5.png").tobytes() == styled.tobytes()
    assert json.loads(Image.open(tmp_path / "f" / "0001_seed5.png").text["diffserve"])["loras"] == {"flip": 1.0}


@pytest.mark.parametrize("value, fragment", [
    ("mirror:9", "argument --lora: invalid value 'mirror:9': must be PATH[:SCALE] with SCALE finite in [-4, 4]"),
    ("mirror:nan", "SCALE finite"),
    ("nothing-here", "argument --lora: invalid value"),
    ("mirror:", "argument --lora: invalid value 'mirror:': must be PATH[:SCALE]"),  # was the name 'mirror_'
    (":0.5", "argument --lora: invalid value ':0.5': must be PATH[:SCALE]"),  # was the name '0.5'
])
def test_bad_lora_flags_are_one_line_errors(value, fragment, tmp_path, capsys):
    assert main(["generate", "a handwritten digit 3", "--lora", value, *FAST, "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_serve_lora_with_a_missing_path_is_a_one_line_usage_error(tmp_path, monkeypatch, capsys, caplog):
    """``serve --lora x=/missing`` names the flag and stops before the server starts (it used to
    start, log the load's ERROR and exit with the loader's message)."""
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--lora", "x=nope.safetensors", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["diffserve: error: argument --lora: invalid value 'x=nope.safetensors': must be NAME=PATH of an "
                   "existing LoRA file or folder (no such file or folder: nope.safetensors)"], err
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_option_parsers():
    assert parse_lora_use("a/b.safetensors:0.5") == ("a/b.safetensors", 0.5)
    assert parse_lora_use("C:\\x.safetensors") == ("C:\\x.safetensors", 1.0)
    assert lora_loads(["s=/x/y", "t=z"]) == {"s": "/x/y", "t": "z"}
    for bad in (["nameonly"], ["=p"], ["a=x", "a=y"]):
        with pytest.raises(InvalidRequestError):
            lora_loads(bad)
