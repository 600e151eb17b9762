"""The input processor every entrypoint builds its requests with (seeds, parameters, inputs,
plans, interactions), without a model: a fake planner stands in for the workers'. And the
engine client: both engines implement it, the whole-request and step runners share one
interface."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import AsyncDiffusionEngine, InvalidRequestError, SamplingParams
from diffserve.core.messages import RequestPlan
from diffserve.core.sampling_params import MAX_SEED, ModelSpec, RequestLimits
from diffserve.engine.client import EngineClient
from diffserve.engine.input_processor import MAX_TRANSITION_CHUNKS, InputProcessor, ProcessedRequest

SPEC = ModelSpec(resolution_factor=16, default_height=64, default_width=64, default_num_inference_steps=4,
                 default_guidance_scale=4.0, pipeline="FakePipeline", accepts_images=True, default_strength=0.6)


def processor(default_seed=None, plans=None):
    def plan(params, inputs):
        if plans is not None:
            plans.append((params, inputs))
        if params.strength is not None and params.strength > 0.9:
            raise InvalidRequestError("strength", params.strength, "at most 0.9 for this family")
        return RequestPlan(rows=2, batch_key=("k", params.height, params.width), num_steps=params.num_inference_steps)

    return InputProcessor(SPEC, RequestLimits(), default_seed, plan)


def test_output_i_runs_with_seed_plus_i():
    requests = processor().process("a cat", SamplingParams(seed=MAX_SEED - 1), n=3)
    assert [r.seed for r in requests] == [MAX_SEED - 1, MAX_SEED, 0]  # mod 2**63
    assert all(isinstance(r, ProcessedRequest) and r.prompt == "a cat" for r in requests)
    assert [r.params.height for r in requests] == [64, 64, 64] and requests[0].num_steps == 4


def test_without_a_seed_the_default_seed_else_a_random_one_starts_the_group():
    assert [r.seed for r in processor(default_seed=10).process("x", n=2)] == [10, 11]
    first, second = processor().process("x", n=2)
    assert 0 <= first.seed < 2**31 and second.seed == first.seed + 1


def test_every_request_is_planned_and_checked_before_anything_is_returned():
    plans = []
    requests = processor(plans=plans).process("x", SamplingParams(num_inference_steps=7, seed=1), n=2)
    assert len(plans) == 2 and [p.seed for p, _ in plans] == [1, 2]  # each its own plan (whole-request keys)
    assert requests[1].plan.num_steps == 7
    for field, params, kwargs in (("num_inference_steps", SamplingParams(num_inference_steps=0), {}),
                                  ("height", SamplingParams(height=65), {}),
                                  ("seed", SamplingParams(seed=-1), {}),
                                  ("n", SamplingParams(), {"n": 0}),
                                  ("prompt", SamplingParams(), {"prompt": 7}),
                                  ("params", "not params", {})):
        with pytest.raises(InvalidRequestError) as error:
            processor().process(kwargs.pop("prompt", "x"), params, **kwargs)
        assert error.value.field == field
    image = np.zeros((40, 80, 3), np.uint8)
    with pytest.raises(InvalidRequestError) as error:  # the family's own rule, from its planner
        processor().process("x", SamplingParams(strength=0.95), inputs=image)
    assert error.value.field == "strength"


def test_an_edit_can_take_its_inputs_size():
    image = np.zeros((50, 80, 3), np.uint8)
    [edit] = processor().process("x", inputs=image, size_from_inputs=True)
    assert (edit.params.width, edit.params.height) == (80, 48)  # rounded to the model's multiple of 16
    assert edit.inputs is not None and edit.inputs.images[0].size == (80, 50)
    [plain] = processor().process("x", inputs=image)
    assert (plain.params.width, plain.params.height) == (64, 64)
    [sized] = processor().process("x", SamplingParams(width=32, height=32), inputs=image, size_from_inputs=True)
    assert (sized.params.width, sized.params.height) == (32, 32)


def test_interactions_are_checked_field_by_field():
    p = processor()
    checked = p.process_interaction({"prompt": "a dog", "transition_chunks": 2, "event_id": "e1"})
    assert (checked.prompt, checked.transition_chunks, checked.event_id) == ("a dog", 2, "e1")
    assert len(p.process_interaction({"prompt": "a dog"}).event_id) == 32  # a fresh uuid
    for bad, field in (({"prompt": "x", "colour": 1}, "colour"), ({}, "prompt"),
                       ({"prompt": "x", "transition_chunks": MAX_TRANSITION_CHUNKS + 1}, "transition_chunks"),
                       ({"prompt": "x", "event_id": ""}, "event_id"), ("x", "interaction")):
        with pytest.raises(InvalidRequestError) as error:
            p.process_interaction(bad)
        assert error.value.field == field


def test_both_engines_are_engine_clients_and_take_processed_requests(engine):
    async_engine = AsyncDiffusionEngine(engine=engine)
    assert isinstance(engine, EngineClient) and isinstance(async_engine, EngineClient)
    requests = engine.input_processor.process("a cat", SamplingParams(seed=3, num_inference_steps=2,
                                                                      output_type="np"), n=2)
    outs = engine.generate(requests)
    assert [o.seed for o in outs] == [3, 4] and all(o.ok for o in outs)
    [alone] = engine.generate("a cat", SamplingParams(seed=4, num_inference_steps=2, output_type="np"))
    assert np.abs(outs[1].images - alone.images).max() <= 1e-4  # output 1 reproduces alone from its seed
    with pytest.raises(InvalidRequestError):
        engine.add_request(requests[0], SamplingParams())  # its params are in it


def test_both_runners_share_one_interface(engine, tiny_folder):
    from diffserve.runner.base import Runner
    from diffserve.runner.whole_request import WholeRequestRunner

    assert isinstance(engine.runner, Runner) and issubclass(WholeRequestRunner, Runner)
    assert WholeRequestRunner.memory_profile is Runner.memory_profile  # no memory profile: the default says so
    assert engine.runner.offload_stats() is not None
