"""Calibration requests for the automatic quantization skip list
(`diffserve.quantization.skip_search`): a few prompts denoised in full precision through the
adapter's own step contract, at a reduced size and step count, recording each denoiser's
forward inputs at every step (so across the whole timestep range).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from diffserve.core.errors import InvalidRequestError
from diffserve.core.inputs import RequestInputs
from diffserve.core.sampling_params import RequestLimits, SamplingParams
from diffserve.pipelines.base import PipelineAdapter, RequestState
from diffserve.quantization.skip_search import CalibrationInputs

if TYPE_CHECKING:
    from diffserve.core.sampling_params import ModelSpec

#: Calibration prompts: a short one and a long, detailed one (token counts differ).
CALIBRATION_PROMPTS = ("a handwritten digit 7", "a red car on a wet city street at night, neon lights")
#: Denoising steps of each calibration request: one recorded forward per step, spread over the
#: schedule from pure noise to nearly clean latents.
CALIBRATION_STEPS = 4
#: Longest side of the calibration images, pixels (the model's default size when smaller).
CALIBRATION_MAX_SIDE = 512


def calibration_params(spec: "ModelSpec", limits: RequestLimits) -> SamplingParams:
    """Resolved parameters of a calibration request: the model's defaults, its default size
    scaled down to at most `CALIBRATION_MAX_SIDE` on the longer side (multiples of the
    resolution factor), `CALIBRATION_STEPS` steps, the fewest frames of a video model."""
    f = spec.resolution_factor
    scale = min(1.0, CALIBRATION_MAX_SIDE / max(spec.default_height, spec.default_width))
    height = max(f, int(spec.default_height * scale) // f * f)
    width = max(f, int(spec.default_width * scale) // f * f)
    frames = spec.frame_factor + 1 if spec.default_num_frames is not None else None
    params = SamplingParams(seed=0, num_inference_steps=min(CALIBRATION_STEPS, limits.max_num_inference_steps),
                            height=height, width=width, num_frames=frames, output_type="latent")
    return params.resolve(spec, limits, 0)


@torch.inference_mode()
def record_calibration(adapter: PipelineAdapter, components: list[str],
                       limits: RequestLimits) -> dict[str, CalibrationInputs]:
    """Denoise the calibration prompts in one batch and record the forward inputs of the
    named denoiser components (``adapter.modules()`` names).

    Returns:
        {component: its recorded inputs} (one call per step it ran).

    Raises:
        KeyError: a name that is not one of the adapter's modules.
    """
    modules = adapter.modules()
    params = calibration_params(adapter.spec, limits)
    inputs = None
    try:
        adapter.check_params(params, None)
    except InvalidRequestError:  # an edit model: it needs an input image
        from PIL import Image

        inputs = RequestInputs(images=[Image.new("RGB", (params.width, params.height), (128, 128, 128))])
    cache, adapter.prompt_embed_cache = adapter.prompt_embed_cache, None  # calibration prompts are not traffic
    try:
        states = []
        for i, prompt in enumerate(CALIBRATION_PROMPTS):
            state = RequestState(f"calibration-{i}", prompt, params, inputs=inputs)
            adapter.prepare(state)
            states.append(state)
        recorded = {name: CalibrationInputs() for name in components}
        with ExitStack() as stack:
            for name in components:
                stack.enter_context(recorded[name].record(modules[name]))
            while not all(s.done for s in states):
                batch = adapter.collate(states)
                adapter.step(batch, adapter.combine(batch, adapter.denoise(batch)))
        for state in states:
            state.release()
    finally:
        adapter.prompt_embed_cache = cache
    return recorded
