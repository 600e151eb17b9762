"""`ModelRunner`: how work runs on one loaded model. It owns every request's state (latents,
prompt embeddings, diffusion scheduler), keyed by request id, and executes the work items of
the executor boundary: prepare new requests, one batched denoising step, decode, end a stream's
chunk (decode it, prepare the next one), free.
Everything runs under `torch.inference_mode()`; a failing request is isolated from the rest of
its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from diffserve.acceleration.accelerator import Accelerator
from diffserve.memory.offload import weights_device
from diffserve.config import EngineConfig
from diffserve.core.errors import InvalidRequestError, NonFiniteOutputError
from diffserve.core.messages import (
    ChunkDone,
    ChunkWork,
    Decoded,
    MemoryProfile,
    ModelInfo,
    NewRequest,
    Prepared,
    RequestPlan,
    StepOutput,
    WorkError,
)
from diffserve.connector.handles import PayloadMissingError
from diffserve.pipelines.base import PipelineAdapter, RequestState, is_finite
from diffserve.runner.base import Runner
from diffserve.runner.loader import load_adapter
from diffserve.lora.rows import ROW_KEY
from diffserve.runner.loras import RunnerLoras
from diffserve.memory.accounting import peak_memory_bytes
from diffserve.runner.model_memory import ModelMemory
from diffserve.runner.quantization import quantize_adapter
from diffserve.runner.streaming import StreamState, assemble_video
from diffserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ModelRunner(Runner):
    """Runs the pipeline adapter of one loaded model on one device.

    Args:
        config: engine configuration (model folder, device, dtype, load format, threads,
            acceleration: prompt-embedding cache, cache backend, compile).
        adapter: an already-built adapter to use instead of loading ``config.model``.

    Raises:
        UnsupportedModelError: the folder is not a diffusers folder or its pipeline class
            has no adapter, or a weight file is missing.
        InvalidRequestError: the configured cache backend does not support this model.
    """

    def __init__(self, config: EngineConfig, adapter: PipelineAdapter | None = None, parallel=None):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        self.parallel = parallel
        self.adapter = adapter or load_adapter(config.model_path, self.device, config.torch_dtype,
                                               config.load_format,
                                               config.context_folding and config.ulysses_degree == 1,
                                               load_device=weights_device(config), variant=config.variant,
                                               transformer_file=config.transformer_file)
        if not config.mixed_sizes:  # batch by size (the adapter's span plug-ins stay inert)
            self.adapter.mixed_sizes = False
        if not config.length_groups:  # mixed-size forwards over the padded rows, with masks
            self.adapter.length_groups = False
        # quantized weights: after load, before Ulysses, offload placement, sleep pool and compile
        self.quantization = quantize_adapter(self.adapter, config)
        if parallel is not None and parallel.world_size > 1 and config.cache_backend != "none":
            raise InvalidRequestError("cache_backend", config.cache_backend, "none with CFG / Ulysses "
                                      "parallelism (its per-request decisions would differ between ranks)")
        if parallel is not None and parallel.ulysses_degree > 1:
            from diffserve.parallel.ulysses import enable_ulysses

            enable_ulysses(self.adapter, parallel)
        self.states: dict[str, RequestState] = {}
        #: streams' chunk bookkeeping, by request id (`streaming.StreamState`)
        self.streams: dict[str, StreamState] = {}
        self.nonfinite_count = 0
        #: the last step's request-id list and its (states, composition), reused while the
        #: caller passes that same list object again (dropped by `free`)
        self._last_ids: list[str] | None = None
        self._last_states: tuple[list[RequestState], tuple[str, ...]] = ([], ())
        # offload placement, sleep mode, memory profile, per-step peaks
        self.memory = ModelMemory(self.adapter, config, self.device,
                                  denoising=lambda: any(not s.done for s in list(self.states.values())),
                                  quantization=self.quantization.plan)
        #: LoRA adapters: reading, slots, per-request pins, per-row batches
        self.loras = RunnerLoras(self.adapter, config)
        self.accelerator = Accelerator(self.adapter, config, stage=self.memory.offload.stage,
                                       warmup_contexts=self.loras.warmup_contexts())
        self.memory.ready()
        #: multi-stage models: the consumer side of the AR stage's connector (in process: the very
        #: object the AR stage puts into, `connector`; in a worker process: shared memory) and the
        #: receiver that fetches each request's payloads from its admission on
        self.connector = None
        self.receiver = None
        if self.adapter.ar_stage_components:
            from diffserve.connector import make_connector
            from diffserve.runner.payload_receiver import PayloadReceiver

            self.connector = make_connector(config.connector_kind)
            self.receiver = PayloadReceiver(self.connector, self.device)

    # ------------------------------------------------------------------ model facts
    def info(self) -> ModelInfo:
        """The model's spec, pipeline class and quantized components."""
        return ModelInfo(spec=self.adapter.spec, pipeline=self.adapter.pipeline_class_name,
                         chunk_streaming=self.adapter.chunk_streaming,
                         ar_stage=bool(self.adapter.ar_stage_components),
                         quantization=self.quantization.summary(),
                         # compiled blocks and CUDA graphs take the padded path
                         padding_free=bool(self.adapter.grouping()
                                           and not self.config.compile and not self.config.cuda_graphs))

    def prefetch(self, request_id: str, handle, params: SamplingParams) -> None:
        """Start fetching an admitted request's AR-stage payloads (the branches its DiT stage
        needs) on the receiver's side thread; `prepare` then waits only for what is left."""
        if self.receiver is not None:
            self.receiver.prefetch(handle, self.adapter.context_branches(params))

    def payload_stats(self) -> dict[str, Any] | None:
        return self.receiver.stats() if self.receiver is not None else None

    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        """Rows and batch key of a request with resolved `params`, after the family's own
        checks.

        Raises:
            InvalidRequestError: a field the family cannot honour (``num_chunks`` on a family
                that cannot stream chunks; a stream of several chunks whose ``num_frames`` leave
                no new frame after the ones a chunk repeats from the previous one).
        """
        if params.num_chunks is not None and not self.adapter.chunk_streaming:
            raise InvalidRequestError("num_chunks", params.num_chunks,
                                      f"unset: {self.adapter.pipeline_class_name} cannot stream video chunks")
        overlap = self.adapter.chunk_overlap_frames
        if (params.num_chunks or 1) > 1 and params.num_frames is not None and params.num_frames <= overlap:
            k = self.adapter.spec.frame_factor
            form = f" of the form {k}*m + 1" if k > 1 else ""
            smallest = next(f for f in range(overlap + 1, overlap + k + 2) if (f - 1) % k == 0)
            raise InvalidRequestError("num_frames", params.num_frames,
                                      f"an integer{form} >= {smallest} with num_chunks > 1 (every chunk after the "
                                      f"first repeats the previous chunk's last {overlap} frame(s), which are not "
                                      "sent again)")
        self.adapter.check_params(params, inputs)
        self.accelerator.check_params(params)
        return RequestPlan(rows=self.adapter.rows(params), batch_key=self.adapter.batch_key(params, inputs),
                           num_steps=self.adapter.num_steps(params, inputs))

    # ------------------------------------------------------------------ work items
    @torch.inference_mode()
    def prepare(self, requests: list[NewRequest]) -> list[Prepared]:
        """Encode prompts and create each request's latents, scheduler and timesteps; start its
        caching state from scratch. A failure is that request's alone."""
        with_images = any(n.inputs is not None and n.inputs.images for n in requests)
        with self.memory.offload.stage("encode", with_images=with_images) as loads:
            results = self._prepare(requests)
        for result in results:
            result.offload_loads = loads
        return results

    def _prepare(self, requests: list[NewRequest]) -> list[Prepared]:
        groups: dict[tuple, list[NewRequest]] = {}  # by text-encoder LoRA adapters: they change the encoding
        for new in requests:
            groups.setdefault(self.loras.text_key(new.params.loras), []).append(new)
        results: dict[str, Prepared] = {}
        for group in groups.values():
            for result in self._prepare_group(group):
                results[result.request_id] = result
        return [results[new.request_id] for new in requests]

    def _prepare_group(self, requests: list[NewRequest]) -> list[Prepared]:
        text = self.adapter.text
        if text is None or len(requests) < 2:
            return self._prepare_each(requests)
        texts = [pair for new in requests for pair in self.adapter.texts_to_encode(new.prompt, new.params)]
        with contextlib.ExitStack() as stack:
            try:  # the group's text-encoder adapters (all equal)
                stack.enter_context(self.loras.encoding(requests[0].params.loras))
            except Exception:  # noqa: BLE001 - an adapter gone: each request reports its own failure
                return self._prepare_each(requests)
            stack.enter_context(text.encoding_together(texts))  # one encoder forward for the new texts
            return self._prepare_each(requests)

    def _prepare_each(self, requests: list[NewRequest]) -> list[Prepared]:
        results = []
        for new in requests:
            start = time.perf_counter()
            state = RequestState(new.request_id, new.prompt, new.params, inputs=new.inputs)
            wait_s = fetch_s = 0.0
            try:
                if self.receiver is not None:
                    if new.context is None:
                        raise PayloadMissingError(f"request {new.request_id!r} reached the DiT stage without the "
                                                  "payloads of its AR stage")
                    state.context, wait_s, fetch_s = self.receiver.receive(
                        new.context, self.adapter.context_branches(new.params))
                self.loras.acquire(state)
                with self.loras.encoding(new.params.loras):
                    self.adapter.prepare(state)
                self.accelerator.reset(state)
            except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
                logger.exception("prepare failed for %s", new.request_id)
                self.loras.release(state)
                state.release()
                if self.receiver is not None:
                    self.receiver.release(new.request_id)
                results.append(Prepared(new.request_id, error=WorkError.of(exc)))
                continue
            self.states[new.request_id] = state
            self._last_ids = None
            if new.params.num_chunks is not None:
                self.streams[new.request_id] = StreamState(new.params.num_chunks)
            results.append(Prepared(new.request_id, num_steps=state.num_steps,
                                    prompt_truncated=state.prompt_truncated,
                                    negative_prompt_truncated=state.negative_prompt_truncated,
                                    seconds=time.perf_counter() - start,
                                    step_key=self.adapter.step_key(state), payload_wait_s=wait_s,
                                    payload_fetch_s=fetch_s,
                                    payload_bytes=sum(p.nbytes for p in (state.context or {}).values())))
        return results

    @torch.inference_mode()
    def step(self, request_ids: list[str]) -> StepOutput:
        """Run ONE denoising step for `request_ids` (same batch key) in one denoiser forward.
        Passing the previous step's list object again means the same requests (a caller does
        not modify a list it passed).

        If the batched forward raises, each request is retried alone so only the ones that
        fail on their own are reported; a failing diffusion-scheduler step fails only its
        own request. A cache backend that cannot share forwards (cache_dit) gets one forward
        per request. Failed requests are freed.

        The output's ``peak_memory_bytes`` is the step's peak above the resident model
        (`ModelMemory.step_peak`).
        """
        start = time.perf_counter()
        if request_ids is self._last_ids:  # the engine's unchanged batch sends the same list every step
            states, composition = self._last_states
        else:
            states, composition = [self.states[i] for i in request_ids], tuple(request_ids)
            if any(ROW_KEY in s.row_data for s in states):  # requests sharing adapters in adjacent rows: slices
                states.sort(key=lambda s: s.row_data.get(ROW_KEY, ()))
            self._last_ids, self._last_states = request_ids, (states, composition)
        with self.memory.offload.stage("denoise") as loads, self.memory.window(composition) as window:
            if len(states) > 1 and not self.accelerator.shares_forward:
                out = self._step_alone(states)
            else:
                out = self._step(states)
        out.offload_loads = loads
        out.peak_memory_bytes = self.memory.step_peak(window, composition)
        for request_id in out.errors:
            self.free([request_id])
        out.seconds = time.perf_counter() - start
        return out

    def _step(self, states: list[RequestState]) -> StepOutput:
        adapter = self.adapter
        saved = self.accelerator.save(states) if len(states) > 1 else None
        try:
            batch = adapter.collate(states)
            guided = adapter.combine(batch, self._denoise(batch))
            failures = adapter.step(batch, guided)
        except Exception as exc:  # noqa: BLE001 - isolate per request
            if len(states) == 1:
                logger.error("step failed for %s: %r", states[0].request_id, exc)
                return StepOutput(num_rows=adapter.rows(states[0].params),
                                  errors={states[0].request_id: WorkError.of(exc)})
            logger.warning("batched step failed (%s); retrying %d requests alone", exc, len(states))
            self.accelerator.restore(states, saved)  # the shared forward may have advanced their caching state
            return self._step_alone(states)
        out = StepOutput(num_rows=batch.num_rows)  # every other state advanced one step
        if failures:
            out.errors = {i: WorkError.of(e) for i, e in failures.items()}
            states = [s for s in states if s.request_id not in failures]
        if adapter.step_keys_vary:  # else steps report none: the engine keeps the one `prepare` reported
            out.step_keys = {s.request_id: adapter.step_key(s) for s in states}
        return out

    def _denoise(self, batch):
        """The batch's forward; with CFG parallelism each rank runs its share of the rows."""
        p = self.parallel
        if p is not None and p.cfg_parallel_size > 1:
            from diffserve.parallel.cfg import cfg_parallel_denoise

            return cfg_parallel_denoise(self._denoise_rows, batch, p.cfg_rank, p.cfg_parallel_size,
                                        p.cfg_group)
        return self._denoise_rows(batch)

    def _denoise_rows(self, batch):
        """The accelerator's forward of `batch`, each row with its LoRA adapters."""
        with self.loras.denoising(batch):
            return self.accelerator.denoise(batch)

    def _step_alone(self, states: list[RequestState]) -> StepOutput:
        """One forward per request; num_rows is the largest forward's, request_rows each one's."""
        out = StepOutput()
        for state in states:
            single = self._step([state])
            out.num_rows = max(out.num_rows, single.num_rows)
            out.request_rows[state.request_id] = single.num_rows
            out.step_keys.update(single.step_keys)
            out.errors.update(single.errors)
        return out

    def snapshot(self, request_ids: list[str]) -> dict[str, tuple[torch.Tensor, int]]:
        """Each request's current (latents copy, steps done): a batch steps its latents in
        place (`diffusion_scheduler.step_batch`), so a preview or decode that runs later, beside
        the next steps, reads this copy."""
        return {i: (self.states[i].latents.clone(), self.states[i].step_index)
                for i in request_ids if i in self.states}

    @torch.inference_mode()
    def decode(self, request_ids: list[str], preview: bool = False,
               snapshots: dict[str, tuple[torch.Tensor, int]] | None = None) -> list[Decoded]:
        """Decode each request's latents (its `snapshot` when given, else its current ones)
        into its output type. A final decode checks that the latents and the decoded pixels are
        finite (NaN/inf, e.g. fp16 overflow, fail the request with `NonFiniteOutputError`
        instead of a black image) and frees the request."""
        with self.memory.offload.stage("decode") as loads:
            results = self._decode(request_ids, preview, snapshots)
        for result in results:
            result.offload_loads = loads
        return results

    def _decode(self, request_ids: list[str], preview: bool,
                snapshots: dict[str, tuple[torch.Tensor, int]] | None) -> list[Decoded]:
        work = []
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is None:  # freed meanwhile (aborted)
                continue
            if snapshots is not None and request_id in snapshots:
                latents, step = snapshots[request_id]
            else:
                latents, step = state.latents, state.step_index
            work.append((request_id, state, latents, step))
        start = time.perf_counter()
        ready, outputs = [], {}
        for request_id, state, latents, step in work:
            if not preview and not is_finite(latents):
                outputs[request_id] = NonFiniteOutputError(
                    "the denoiser produced non-finite latents (NaN/inf; e.g. fp16 overflow: try "
                    "--dtype bf16 or fp32, or a lower guidance_scale)")
            else:
                ready.append((request_id, state, latents))
        if ready:
            decoded = self.adapter.decode_many([w[1] for w in ready], [w[2] for w in ready])
            outputs.update({w[0]: out for w, out in zip(ready, decoded)})
        seconds = time.perf_counter() - start
        results = []
        for request_id, state, latents, step in work:
            output = outputs[request_id]
            if not isinstance(output, Exception) and not preview:
                try:
                    _check_finite_output(output)
                except NonFiniteOutputError as exc:
                    output = exc
            if isinstance(output, Exception):
                if isinstance(output, NonFiniteOutputError):
                    self.nonfinite_count += 1
                    logger.error("%s: %s", request_id, output)
                elif preview:
                    logger.warning("preview failed for %s: %r", request_id, output)
                else:
                    logger.error("decode failed for %s: %r", request_id, output)
                results.append(Decoded(request_id, step=step, preview=preview, error=WorkError.of(output)))
            else:
                cache = None if preview else self.accelerator.request_summary(state)
                results.append(Decoded(request_id, output=output, step=step, preview=preview, seconds=seconds,
                                       cache=cache))
            if not preview:
                self.free([request_id])
        return results

    @torch.inference_mode()
    def chunk(self, works: list[ChunkWork]) -> list[ChunkDone]:
        """End the current chunk of streams whose chunk finished denoising: decode it (uint8
        frames), then either return the whole video and free the stream (its last chunk) or set
        it up for the next chunk: the interactions' prompts encoded and blended into the
        conditional branch (`streaming.StreamState.next_branch`), fresh latents conditioned on
        this chunk (`PipelineAdapter.start_chunk`), a fresh cache-backend state. A failure is
        that stream's alone (it is freed)."""
        with self.memory.offload.stage("encode", with_images=True) as loads:  # text encoders + VAE
            results = [self._chunk(work) for work in works]
        for result in results:
            result.offload_loads = loads
        return results

    def _chunk(self, work: ChunkWork) -> ChunkDone:
        start = time.perf_counter()
        request_id = work.request_id
        state, stream = self.states.get(request_id), self.streams.get(request_id)
        if state is None or stream is None:  # freed meanwhile (aborted)
            return ChunkDone(request_id, error=WorkError("KeyError", f"no stream {request_id!r} on this worker"))
        index = stream.chunk_index
        try:
            if not is_finite(state.latents):
                raise NonFiniteOutputError("the denoiser produced non-finite latents (NaN/inf; e.g. fp16 overflow: "
                                           "try --dtype bf16 or fp32, or a lower guidance_scale)")
            as_np = dataclasses.replace(state.params, output_type="np")
            [frames] = self.adapter.decode(dataclasses.replace(state, params=as_np))
            _check_finite_output(frames)
            new = frames if index == 0 else frames[self.adapter.chunk_overlap_frames:]
            stream.frames.append(new)
            event_ids = stream.take_event_ids()
            if stream.last:
                video = assemble_video(stream.frames, state.params.output_type)
                self.free([request_id])
                return ChunkDone(request_id, chunk_index=index, frames=new, video=video, event_ids=event_ids,
                                 seconds=time.perf_counter() - start)
            with self.loras.encoding(state.params.loras):
                interactions = [(i, self.adapter.text_branch(state, i.prompt)) for i in work.interactions]
            state.branches[-1] = stream.next_branch(state.branches[-1], interactions)
            self.adapter.start_chunk(state, frames)
            self.accelerator.reset(state)
        except Exception as exc:  # noqa: BLE001 - one stream's failure stays its own
            if isinstance(exc, NonFiniteOutputError):
                self.nonfinite_count += 1
            logger.error("chunk %d of %s failed: %r", index, request_id, exc)
            self.free([request_id])
            return ChunkDone(request_id, chunk_index=index, error=WorkError.of(exc))
        return ChunkDone(request_id, chunk_index=index, frames=new, event_ids=event_ids, num_steps=state.num_steps,
                         step_key=self.adapter.step_key(state), seconds=time.perf_counter() - start)

    def free(self, request_ids: list[str]) -> None:
        """Drop the states of finished, failed or aborted requests (unknown ids are ignored)."""
        self._last_ids = None
        for request_id in request_ids:
            self.streams.pop(request_id, None)
            state = self.states.pop(request_id, None)
            if state is not None:
                self.loras.release(state)
                state.release()
            if self.receiver is not None:
                self.receiver.release(request_id)

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read the adapter at `path` as `name` (see `RunnerLoras.load`); its summary."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (see `RunnerLoras.unload`)."""
        self.loras.unload(name)

    # ------------------------------------------------------------------ stats
    def acceleration_stats(self) -> dict[str, Any]:
        """Prompt-embedding cache, cache backend and compile counters (see
        `diffserve.acceleration.accelerator.Accelerator.stats`)."""
        return self.accelerator.stats()

    def peak_memory_bytes(self) -> int:
        """CUDA allocator peak (bytes) on GPU; process peak RSS (bytes) on CPU."""
        return peak_memory_bytes(self.device)

    # ------------------------------------------------------------------ memory
    def offload_stats(self) -> dict[str, Any]:
        """Offload placement and counters (see `ModelMemory.stats`)."""
        return self.memory.stats()

    def memory_profile(self) -> MemoryProfile:
        """The model's `MemoryProfile` (see `ModelMemory.profile`)."""
        return self.memory.profile(self.config.limits)

    def sleep(self, level: int) -> None:
        """Sleep mode with no request held (see `ModelMemory.sleep`)."""
        self.memory.sleep(level, len(self.states), self.accelerator.prompt_cache)

    def wake_up(self) -> None:
        """Restore the weights put to sleep (see `ModelMemory.wake_up`)."""
        self.memory.wake_up()


def _check_finite_output(output: Any) -> None:
    """Raise `NonFiniteOutputError` when a tensor / array output holds NaN or inf (PIL images
    are checked by the adapters before conversion)."""
    import numpy as np

    if isinstance(output, torch.Tensor):
        bad = output.is_floating_point() and not bool(torch.isfinite(output).all())
    elif isinstance(output, np.ndarray):
        bad = output.dtype.kind == "f" and not bool(np.isfinite(output).all())
    else:
        return
    if bad:
        raise NonFiniteOutputError("the VAE decode produced non-finite pixels (NaN/inf; e.g. fp16 overflow)")
