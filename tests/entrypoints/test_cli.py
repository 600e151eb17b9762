"""The `diffserve` command: PNGs written with their metadata, exit codes, one-line errors naming
the flag as typed, help text, warnings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from diffserve.entrypoints.cli import main
from diffserve.entrypoints.cli_args import build_parser


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
        (["--steps", "0"], "argument --steps: invalid value 0: must be an integer in [1, 200]"),
        (["--size", "64"], "argument --size: invalid value '64'"),
        (["--size", "65x64"], "argument --size: invalid width=65: must be a positive multiple of 16"),
        (["--guidance", "-2"], "argument --guidance: invalid value -2.0: must be a finite number in [0, 100]"),
        (["-n", "0"], "argument -n: invalid value 0: must be an integer in [1, 10]"),
        (["--num-images", "11"], "argument --num-images: invalid value 11"),
        (["--size", "²x8"], "argument --size: invalid value"),
        (["--size", "-8x8"], "argument --size: invalid value '-8x8': must be WIDTHxHEIGHT"),
        (["--threads", "0"], "argument --threads: invalid value 0"),
        (["--display-size", "100000"], "argument --display-size: invalid value 100000"),
        (["-o", "/dev/null/x"], "argument -o: invalid value '/dev/null/x'"),
        (["--seed", "-1"], "argument --seed: invalid value -1"),
        (["--negative-prompt", "a\x00b"], "argument --negative-prompt: invalid value 'a\\x00b': must be text "
                                          "without NUL or control characters"),
        (["--prompt", "a digit\x07"], "argument --prompt: invalid value 'a digit\\x07'"),
        (["--prompt", "   "], "argument --prompt: invalid value '   ': must be a non-empty"),
        (["--cache-config", "{bad"], "argument --cache-config: invalid value '{bad': must be a JSON object"),
        (["--cache-backend", "teacache", "--cache-config", '{"levels": {"fast": {"interval": Infinity}}}'],
         "argument --cache-config: invalid levels.fast.interval=inf: must be a number >= 0, finite"),
        (["--cache-backend", "teacache", "--cache-config", '{"levels": {"fast": {"speed": 2}}}'],
         "argument --cache-config: invalid levels.fast='speed': must be a field among"),
        (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--quantization", "int8_dynamic", "--quantization-skip", ""],  # was accepted, matching nothing
         "argument --quantization-skip: invalid value '': must be 'auto', layer-name patterns"),
        (["--quantization", "int8_dynamic", "--quantization-skip", "["],
         "argument --quantization-skip: invalid value '['"),
        (["--quantization", "int8_dynamic", "--quantization-skip", "a,,b"],
         "argument --quantization-skip: invalid value 'a,,b': must be 'auto'"),
        (["--transformer-file", "missing.gguf"],  # was the loader's message, without the flag
         "argument --transformer-file: invalid value 'missing.gguf': must be an existing GGUF"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_the_flag(tiny_sd3_dir, tmp_path, capsys, args, fragment):
    out = [] if "-o" in args else ["-o", str(tmp_path / "out")]
    prompt = [] if "--prompt" in args else ["a cat"]
    argv = ["generate", "--model", str(tiny_sd3_dir), *prompt, *out, *args]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors (types, choices)
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffserve: error: ") and fragment in err[0], err
    assert not (tmp_path / "out").exists(), "a failed command must leave no output folder"


def test_argument_errors_come_before_any_heavy_import(tmp_path):
    """A mistyped value answers without importing torch, diffusers or transformers."""
    code = ("import sys; from diffserve.entrypoints.cli import main\n"
            "rc = main(['generate', 'a digit', '--steps', '0', '-o', sys.argv[1]])\n"
            "print(rc, sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split() == ["2", "[]"], (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == ("diffserve: error: argument --steps: invalid value 0: must be an integer in "
                                   "[1, 200]")


def test_prompt_positional_or_option(tiny_sd3_dir, tmp_path, capsys):
    common = ["generate", "--model", str(tiny_sd3_dir), "--steps", "1", "--size", "16x16", "--seed", "3"]
    assert main([*common, "a red square", "-o", str(tmp_path / "pos")]) == 0
    assert main([*common, "--prompt", "a red square", "-o", str(tmp_path / "opt")]) == 0
    first, second = capsys.readouterr().out.split()
    assert np.array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(second)))
    for argv, message in ((["a", "--prompt", "b"], "give the prompt once"), ([], "a prompt is required")):
        with pytest.raises(SystemExit) as info:
            main([*common, *argv, "-o", str(tmp_path / "x")])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_help_shows_help_and_default_of_every_option():
    parser = build_parser()
    for name, command in parser.commands.items():
        text = command.format_help()
        for action in command._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
            # the option's own help paragraph mentions its default
            flag = action.option_strings[-1]
            paragraph = re.search(rf"^  (?:-\w[ ,\w]*, )?{re.escape(flag)}\b.*?(?=^  -|\Z)", text, re.S | re.M)
            assert paragraph and "default" in paragraph.group(0), (name, flag, paragraph and paragraph.group(0))


def _png_text(path) -> dict:
    with Image.open(path) as image:
        image.load()
        return dict(image.text)


def test_output_names_sort_in_generation_order_and_carry_seed_and_metadata(tiny_sd3_dir, tmp_path, capsys):
    common = ["generate", "--model", str(tiny_sd3_dir), "a cat", "--steps", "2", "--size", "32x32",
              "--guidance", "3.5", "--negative-prompt", "blurry, ünïcode", "-o", str(tmp_path / "o")]
    assert main([*common, "-n", "3", "--seed", "40"]) == 0
    many = capsys.readouterr().out.split()
    assert [os.path.basename(p) for p in many] == ["0001_seed40.png", "0002_seed41.png", "0003_seed42.png"]
    assert main([*common, "--seed", "41", "--display-size", "64"]) == 0
    [one] = capsys.readouterr().out.split()
    assert os.path.basename(one) == "0004_seed41.png"  # numbering continues after earlier runs
    assert sorted(os.listdir(tmp_path / "o")) == ["0001_seed40.png", "0002_seed41.png", "0003_seed42.png",
                                                  "0004_seed41.png", "0004_seed41_raw.png"]
    a = np.asarray(Image.open(many[1]), dtype=int)
    b = np.asarray(Image.open(tmp_path / "o" / "0004_seed41_raw.png"), dtype=int)
    assert np.abs(a - b).max() <= 1  # image i reproduces alone with seed + i (batched: float rounding)
    for path in (many[1], one, tmp_path / "o" / "0004_seed41_raw.png"):
        text = _png_text(path)
        assert json.loads(text["diffserve"]) == {
            "prompt": "a cat", "negative_prompt": "blurry, ünïcode", "num_inference_steps": 2,
            "guidance_scale": 3.5, "seed": 41, "width": 32, "height": 32,
            "model": os.path.basename(os.path.realpath(tiny_sd3_dir))}
        assert text["parameters"] == (f"a cat\nNegative prompt: blurry, ünïcode\nSteps: 2, CFG scale: 3.5, "
                                      f"Seed: 41, Size: 32x32, Model: {os.path.basename(os.path.realpath(tiny_sd3_dir))}")


def test_builtin_model_warnings_print_once_with_the_limit(tmp_path, capsys):
    long_prompt = "a handwritten digit seven " * 8
    assert main(["generate", long_prompt, "-n", "3", "--steps", "1", "--threads", "1",
                 "-o", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line]
    assert lines == ["diffserve: warning: the prompt is longer than the text encoder's limit of 16 tokens and "
                     "was truncated"], err
    assert "Token indices sequence length" not in err  # transformers' own, misleading message is hidden
    # a prompt of symbols only: nothing the built-in model can read
    assert main(["generate", "★ ✓ ∞ !!", "--steps", "1", "--threads", "1", "-o", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "warning" in line] == [
        "diffserve: warning: words outside the default model's vocabulary are spelled out byte by byte and "
        "mostly ignored: ★ ✓ ∞ !!"], err
    assert main(["generate", "the number 7", "--steps", "1", "--threads", "1", "-o", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("load_format", ["default", "dummy"])
def test_generate_in_a_fresh_process_shows_no_inapplicable_library_warning(tiny_sd3_dir, tmp_path, load_format):
    """fp16 on CPU, the torchvision fallback and (dummy weights, cast to a dtype) the empty
    "kept in float32: []" warnings of diffusers/transformers do not apply."""
    proc = subprocess.run([sys.executable, "-m", "diffserve", "generate", "--model", str(tiny_sd3_dir), "a cat",
                           "--dtype", "fp16", "--device", "cpu", "--steps", "1", "--size", "16x16", "--seed", "7",
                           "--threads", "1", "--load-format", load_format, "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "0001_seed7.png")
    noise = [line for line in proc.stderr.splitlines()
             if "float16" in line or "float32" in line or "torchvision" in line or "warning" in line.lower()]
    assert not noise, proc.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc (a folder nothing can be created in)")
def test_unwritable_output_folder_is_refused_before_any_compute(tmp_path):
    """-o where no folder can be created answers at once, before the model loads (no torch)."""
    proc = subprocess.run([sys.executable, "-c", "import sys\nfrom diffserve.entrypoints.cli import main\n"
                           "code = main(['generate', '7', '-o', '/proc/diffserve-out'])\n"
                           "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(code)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("diffserve: error: argument -o: invalid value "
                                                             "'/proc/diffserve-out': must be a writable folder")
    assert (tmp_path / "file").write_text("x") and main(["generate", "7", "-o", str(tmp_path / "file" / "out")]) == 2


def test_missing_model_folder_exits_2_and_leaves_no_folder(tmp_path):
    out = tmp_path / "out" / "deeper"
    proc = subprocess.run([sys.executable, "-m", "diffserve", "generate", "--model", str(tmp_path / "nope"),
                           "x", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("diffserve: error:")
    assert not (tmp_path / "out").exists()


def test_serve_without_the_serve_extra_says_what_to_install():
    """The main job's install has no HTTP server packages: ``serve`` says which extra adds them."""
    code = ("import sys\nsys.modules['fastapi'] = None\nfrom diffserve.entrypoints.cli import main\n"
            "sys.exit(main(['serve', '--port', '0']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("diffserve: error: serve needs the HTTP server's packages (fastapi is missing): "
                                   "pip install 'diffserve[serve]'")


def test_sampler_clip_skip_and_eta_flags(tiny_sd15_dir, tmp_path, capsys):
    """``--scheduler``, ``--clip-skip``, ``--eta``: the image equals the offline API's for the
    same fields, and its metadata records them (A1111's names: Sampler, Schedule type, Clip skip
    counting the last layer as 1, Eta DDIM)."""
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams
    from diffserve.media.metadata import read_image_metadata

    common = ["generate", "--model", str(tiny_sd15_dir), "a red door", "--steps", "3", "--size", "64x64",
              "--seed", "4", "--guidance", "5"]
    assert main([*common, "--scheduler", "dpmpp_2m_karras", "--clip-skip", "1", "-o", str(tmp_path / "a")]) == 0
    assert main([*common, "--scheduler", "ddim", "--eta", "0.4", "-o", str(tmp_path / "b")]) == 0
    [karras] = (tmp_path / "a").glob("*.png")
    [ddim] = (tmp_path / "b").glob("*.png")
    meta = read_image_metadata(karras.read_bytes())
    assert (meta["diffserve"]["scheduler"], meta["diffserve"]["clip_skip"]) == ("dpmpp_2m_karras", 1)
    assert "Steps: 3, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 5" in meta["parameters"]
    assert "Clip skip: 2" in meta["parameters"]
    assert "Sampler: DDIM" in read_image_metadata(ddim.read_bytes())["parameters"]
    assert "Eta DDIM: 0.4" in read_image_metadata(ddim.read_bytes())["parameters"]
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd15_dir)))
    try:
        [offline] = engine.generate("a red door", SamplingParams(seed=4, num_inference_steps=3, height=64, width=64,
                                                                 guidance_scale=5.0, scheduler="dpmpp_2m_karras",
                                                                 clip_skip=1))
        assert np.array_equal(np.asarray(offline.images[0]), np.asarray(Image.open(karras)))
    finally:
        engine.shutdown()
    capsys.readouterr()
    for flags, fragment in ((["--scheduler", "heun"], "argument --scheduler: invalid choice: 'heun'"),
                            (["--eta", "1.5"], "argument --eta: invalid value 1.5: must be a number in [0, 1]"),
                            (["--clip-skip", "0"], "argument --clip-skip: invalid value 0"),
                            (["--scheduler", "euler", "--eta", "0.5"], "argument --eta: invalid value 0.5: must be "
                                                                        "unset: eta applies to DDIM-type")):
        try:
            code = main([*common, *flags, "-o", str(tmp_path / "c")])
        except SystemExit as exc:  # argparse's own (choices)
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and err.count("\n") == 1, err
    capsys.readouterr()
    code = main(["generate", "a digit", "--scheduler", "euler_a", "-o", str(tmp_path / "d")])  # digits: flow
    assert code == 2
    assert "argument --scheduler: invalid value 'euler_a': must be one of euler, dpmpp_2m, unipc" in \
        capsys.readouterr().err


def test_priority_and_deadline_flags_reach_the_request(tmp_path, capsys):
    """``--priority`` and ``--deadline-s`` become ``SamplingParams.priority`` / ``deadline_s``
    (checked before the model loads), and a run under ``--scheduling-policy slo`` serves them."""
    from diffserve.entrypoints.cli import check_generate_arguments

    parser = build_parser()
    argv = ["generate", "a digit 3", "--priority", "-2", "--deadline-s", "45.5", "-o", str(tmp_path / "x")]
    args = parser.parse_args(argv)
    job = check_generate_arguments(args, parser.commands["generate"])
    assert (job.params.priority, job.params.deadline_s) == (-2, 45.5)
    args = parser.parse_args(["generate", "a digit 3", "-o", str(tmp_path / "x")])
    job = check_generate_arguments(args, parser.commands["generate"])
    assert (job.params.priority, job.params.deadline_s) == (0, None)  # the defaults: no urgency, no deadline
    rc = main(["generate", "a digit 3", "--steps", "2", "--seed", "1", "--scheduling-policy", "slo", "--priority",
               "1", "--deadline-s", "600", "-o", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    assert len(capsys.readouterr().out.split()) == 1


@pytest.mark.parametrize("flags,fragment", [
    (["--deadline-s", "0"], "argument --deadline-s: invalid value 0.0: must be a positive finite number"),
    (["--deadline-s", "-3"], "argument --deadline-s: invalid value -3.0"),
    (["--deadline-s", "inf"], "argument --deadline-s: invalid value inf"),
    (["--deadline-s", "nan"], "argument --deadline-s: invalid value nan"),
    (["--deadline-s", "soon"], "argument --deadline-s: invalid float value: 'soon'"),
    (["--priority", str(2**31)], f"argument --priority: invalid value {2**31}: must be an integer in"),
    (["--priority", "1.5"], "argument --priority: invalid int value: '1.5'"),
])
def test_bad_priority_and_deadline_name_the_flag(tmp_path, capsys, flags, fragment):
    try:
        rc = main(["generate", "a digit 3", "-o", str(tmp_path / "out"), *flags])
    except SystemExit as exc:  # argparse's own (types)
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "out").exists()
