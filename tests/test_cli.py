"""The `diffserve generate` command: PNGs written, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys

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
        (["-n", "0"], "num_images_per_prompt"),
        (["--steps", "abc"], "--steps"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tiny_sd3_dir, tmp_path, capsys, args, fragment):
    with pytest.raises(SystemExit) if args == ["--steps", "abc"] else _no_exit():
        rc = main(["generate", "--model", str(tiny_sd3_dir), "--prompt", "a cat", "-o", str(tmp_path), *args])
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffserve: error:") and fragment in err[0]
    assert "Traceback" not in err[0]


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
