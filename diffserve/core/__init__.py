"""Shared types: what every layer of diffserve speaks, importing nothing else of diffserve.

- `sampling_params`: `SamplingParams` (one request's settings), `ModelSpec` (a model's defaults
  and what it refuses), `RequestLimits`, prompt validation;
- `inputs`: `RequestInputs` (input images, mask) and `make_inputs` / image file reading;
- `outputs`: `GenerationOutput`, `StreamEvent` / `EventType`, `RequestMetrics`, `RequestStatus`;
- `errors`: the error types (each names the field and the allowed range where it can);
- `messages`: the plain-data work items and results between the engine and its workers
  (`NewRequest`, `Prepared`, `StepOutput`, ... `ModelInfo`, `RequestPlan`, `MemoryProfile`);
- `memory_size`: sizes as users write them (``24GiB``); `sleep_levels`: sleep mode's levels;
- `library_warnings`: filters for diffusers/transformers warnings that do not apply.

Nothing here imports torch at module level.
"""
