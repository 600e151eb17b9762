"""The `diffserve generate` command: PNGs written, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from diffserve.entrypoints.cli import main


def test_generate_writes_pngs(tiny_sd3_dir, tmp_path, capsys):
    rc = main(["generate", "--model", str(tiny_sd3_dir), "--prompt", "a cat", "-n", "2", "--steps", "2",
               "--size", "48x32", "--seed", "5", "-o", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 2
    for path in printed:
        assert Image.open(path).size == (48, 32)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--steps", "0"], "num_inference_steps"),
        (["--size", "64"], "size"),
        (["--size", "65x64"], "width"),
        (["--guidance", "-2"], "guidance_scale"),
        (["-n", "0"], "num_images"),
        (["--size", "²x8"], "size"),
        (["--threads", "0"], "num_threads"),
        (["--display-size", "100000"], "display_size"),
        (["-o", "/dev/null/x"], "output_dir"),
        (["--steps", "abc"], "--steps"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tiny_sd3_dir, tmp_path, capsys, args, fragment):
    out = [] if "-o" in args else ["-o", str(tmp_path)]
    with pytest.raises(SystemExit) if args == ["--steps", "abc"] else _no_exit():
        rc = main(["generate", "--model", str(tiny_sd3_dir), "--prompt", "a cat", *out, *args])
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffserve: error:") and fragment in err[0]
    assert "Traceback" not in err[0]


def test_n_images_use_consecutive_seeds_and_each_reproduces_alone(tiny_sd3_dir, tmp_path, capsys):
    common = ["generate", "--model", str(tiny_sd3_dir), "--prompt", "a cat", "--steps", "2", "--size", "32x32"]
    assert main([*common, "-n", "3", "--seed", "40", "-o", str(tmp_path / "many")]) == 0
    many = capsys.readouterr().out.split()
    assert [p.split("_seed")[1] for p in many] == ["40.png", "41.png", "42.png"]
    assert main([*common, "--seed", "41", "-o", str(tmp_path / "one")]) == 0
    [one] = capsys.readouterr().out.split()
    a = np.asarray(Image.open(many[1]), dtype=int)
    b = np.asarray(Image.open(one), dtype=int)
    assert np.abs(a - b).max() <= 1  # batched vs alone: float rounding at most


def test_missing_model_folder_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diffserve", "generate", "--model", str(tmp_path / "nope"),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("diffserve: error:")


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
