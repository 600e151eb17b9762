"""`ARStageRunner`: runs a model's autoregressive (AR) stage for many requests at once, beside
the DiT stage.

Requests are submitted as they arrive (`ARStageRunner.submit`, non-blocking; a
``concurrent.futures.Future`` per request). Two ways to batch them, chosen by the family's
`diffserve.pipelines.ar_stage.ARStageModel`:

- **continuous batching** (transformers' own, ``init_continuous_batching``): ONE manager is
  created at start-up, warmed up once and kept alive; each request is added to it as soon as it
  is submitted, and transformers batches the prefill and decode steps of all requests in flight
  (a request joins and leaves between decode steps);
- **batched generate** otherwise: a scheduler thread takes the waiting requests, up to
  ``max_batch`` of one group, and runs one batched ``generate`` (each row sampled with its own
  seed), while new requests wait for the next round.

When requests finish generating, their payloads are made in one batched call
(`ARStageModel.products`, e.g. one forward exporting the LM's K/V) and put into the connector;
the future resolves with an `ARDone` (the `PayloadHandle`, the text, timings and bytes).

Failures stay per request: a generation error, a failing batched generate (retried one request
at a time) or a failing payload export fails only the requests concerned, with the error in the
future. `abort` cancels a request wherever it is (waiting, generating, exporting); its payloads
are never put, or freed at once. `free` drops the payloads of finished requests (the engine calls
it when a request ends in any stage).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diffserve.connector.base import Connector
from diffserve.connector.handles import PayloadHandle
from diffserve.pipelines.ar_stage import ARInput, ARProduct, ARStageModel, cut_at_eos
from diffserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Longest the scheduler / collector threads block before re-checking (seconds).
_POLL_S = 0.02

#: Runners not shut down yet. transformers' continuous-batching manager runs a NON-daemon thread,
#: so a program that exits without `ARStageRunner.shutdown` (an engine never shut down) would wait
#: for it forever; `_shut_down_live_runners` stops them first.
_LIVE_RUNNERS: weakref.WeakSet[ARStageRunner] = weakref.WeakSet()


def _shut_down_live_runners() -> None:
    """Shut down every live runner (at interpreter exit, before non-daemon threads are joined)."""
    for runner in list(_LIVE_RUNNERS):
        runner.shutdown()


# `threading._register_atexit` (what `concurrent.futures` uses) runs before the interpreter joins
# non-daemon threads; a plain `atexit` handler would run only after that join, i.e. never.
threading._register_atexit(_shut_down_live_runners)


class ARAbortedError(RuntimeError):
    """The request was aborted before its AR stage finished."""


@dataclass
class ARDone:
    """A request's finished AR stage.

    Attributes:
        handle: its payloads in the connector.
        text: the AR stage's text (e.g. the LM's answer), or None.
        num_tokens: tokens generated.
        queue_s: seconds from submission to the start of its generation.
        generate_s: seconds generating (its share of batched rounds: wall time of its rounds).
        export_s: seconds making and putting its payloads (wall time of its batch's call).
        nbytes: bytes of its payloads (all branches).
    """

    handle: PayloadHandle
    text: str | None
    num_tokens: int
    queue_s: float
    generate_s: float
    export_s: float
    nbytes: int


@dataclass
class _Work:
    ar_input: ARInput
    future: Future
    submitted: float
    started: float | None = None
    generated: list[int] | None = None
    finished: float | None = None
    on_delta: Callable[[str], None] | None = None
    text_so_far: str = ""


class ARStageRunner:
    """Runs an `ARStageModel` (see the module docstring).

    Args:
        model: the family's AR stage model.
        connector: where the payloads go (the producer side).
        max_batch: most requests in one batched ``generate`` round.
        continuous_batching: override the model's choice (None: `ARStageModel.continuous_batching`).
        warmup: run one short request through continuous batching at start-up (its first use
            is slow: the manager sizes its cache).
    """

    def __init__(self, model: ARStageModel, connector: Connector, max_batch: int = 32,
                 continuous_batching: bool | None = None, warmup: bool = True):
        self.model = model
        self.connector = connector
        self.max_batch = max_batch
        self.continuous_batching = model.continuous_batching if continuous_batching is None else continuous_batching
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[_Work] = deque()
        self._running: dict[str, _Work] = {}
        self._finished: deque[_Work] = deque()
        self._aborted: set[str] = set()
        #: requests whose future is not resolved yet
        self._inflight: set[str] = set()
        self._stop = False
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "aborted": 0, "tokens": 0, "rounds": 0,
                         "generate_s": 0.0, "export_s": 0.0}
        self._manager = None
        _LIVE_RUNNERS.add(self)
        if self.continuous_batching:
            self._start_manager(warmup)
        self._threads = [threading.Thread(target=self._export_loop, name="ar-export", daemon=True)]
        self._threads.append(threading.Thread(
            target=self._collect_loop if self.continuous_batching else self._generate_loop,
            name="ar-generate", daemon=True))
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ API
    def submit(self, request_id: str, prompt: str, params: SamplingParams,
               on_delta: Callable[[str], None] | None = None) -> "Future[ARDone]":
        """Queue a request's AR stage; returns its future (`ARDone`, or the request's own error).

        Args:
            on_delta: called (on a runner thread) with each new piece of the request's text as
                it is generated: token by token with continuous batching, the whole text at the
                end otherwise; the pieces add up to `ARDone.text`.

        Raises:
            InvalidRequestError: the prompt does not fit the LM (`ARStageModel.inputs`).
        """
        ar_input = self.model.inputs(request_id, prompt, params)
        work = _Work(ar_input, Future(), time.perf_counter(), on_delta=on_delta)
        with self._lock:
            if self._stop:
                raise RuntimeError("the AR stage is shut down")
            self.counters["requests"] += 1
            self._aborted.discard(request_id)
            self._inflight.add(request_id)
            if self.continuous_batching:
                work.started = time.perf_counter()
                self._running[request_id] = work
            else:
                self._waiting.append(work)
                self._wake.notify_all()
        if self.continuous_batching:
            added = self._manager.add_request(ar_input.prompt_ids, request_id=request_id,
                                              max_new_tokens=ar_input.max_new_tokens, streaming=on_delta is not None)
            if added is None:
                with self._lock:
                    self._running.pop(request_id, None)
                work.future.set_exception(RuntimeError("the continuous-batching manager refused the request"))
        return work.future

    def abort(self, request_id: str) -> None:
        """Stop a request's AR stage wherever it is (waiting, generating, exporting); its future
        fails with `ARAbortedError` (if not resolved yet) and its payloads are freed, now or
        (while they are being exported) as soon as they are put."""
        work, cancel = None, False
        with self._lock:
            if request_id in self._inflight:
                self._aborted.add(request_id)
                work = next((w for w in self._waiting if w.ar_input.request_id == request_id), None)
                if work is not None:
                    self._waiting.remove(work)
                elif request_id in self._running:  # generating
                    work = self._running[request_id]
                    if self.continuous_batching:
                        del self._running[request_id]
                        cancel = True
                else:  # generated, waiting for its export (or being exported: `_export` checks)
                    work = next((w for w in self._finished if w.ar_input.request_id == request_id), None)
                    if work is not None:
                        self._finished.remove(work)
        if cancel:
            self._manager.cancel_request(request_id)
        if work is not None:
            self._fail(work, ARAbortedError(f"request {request_id!r} aborted during its AR stage"), aborted=True)
        self.connector.free(request_id)

    def free(self, request_ids: list[str]) -> None:
        """Drop requests' payloads (idempotent); a request still in its AR stage is aborted."""
        for request_id in request_ids:
            with self._lock:
                in_flight = request_id in self._inflight
            if in_flight:
                self.abort(request_id)
            self.connector.free(request_id)

    def stats(self) -> dict[str, Any]:
        """Counters (requests, finished, failed, aborted, tokens, generate rounds, seconds) and
        the connector's accounting."""
        with self._lock:
            out = dict(self.counters, waiting=len(self._waiting), running=len(self._running),
                       continuous_batching=self.continuous_batching)
        out["connector"] = self.connector.stats().as_dict()
        return out

    def shutdown(self) -> None:
        """Stop the threads and the continuous-batching manager; pending requests fail. Calling
        it again does nothing."""
        _LIVE_RUNNERS.discard(self)
        with self._lock:
            if self._stop:
                return
            self._stop = True
            pending = list(self._waiting) + list(self._running.values()) + list(self._finished)
            self._waiting.clear()
            self._running.clear()
            self._finished.clear()
            self._wake.notify_all()
        for work in pending:
            self._fail(work, RuntimeError("the AR stage shut down"))
        if self._manager is not None:
            try:
                self._manager.stop(block=True, timeout=5, hard_stop=True)  # pending requests failed above
            except Exception:  # noqa: BLE001
                logger.exception("stopping the continuous-batching manager failed")
            if self._manager.is_running():
                logger.warning("transformers' continuous-batching thread did not stop within 5 s")
        for thread in self._threads:
            thread.join(timeout=5)

    # ------------------------------------------------------------------ continuous batching
    def continuous_batching_config(self) -> Any:
        """transformers' ``ContinuousBatchingConfig`` sized for this stage: ``max_batch`` requests
        of at most `ARStageModel.max_context_tokens` tokens each. (Left to itself, the manager
        sizes its paged cache from the free memory: on a CPU that is most of the RAM, ~12 GB and
        ~25 s of start-up for a 400 k-parameter LM.)"""
        from transformers import ContinuousBatchingConfig

        tokens = max(int(self.model.max_context_tokens()), 1)
        page = max(16, min(256, 1 << (tokens - 1).bit_length()))
        pages = -(-tokens // page)
        return ContinuousBatchingConfig(page_size=page, num_blocks=self.max_batch * pages + 1,
                                        max_batch_tokens=max(page, self.max_batch * tokens),
                                        max_requests_per_batch=self.max_batch)

    def _start_manager(self, warmup: bool) -> None:
        lm = self.model.language_model
        with torch.inference_mode():
            self._manager = lm.init_continuous_batching(generation_config=self.model.generation_config(),
                                                        continuous_batching_config=self.continuous_batching_config())
            self._manager.start()
        if warmup:
            self._manager.add_request([int(self.model.generation_config().bos_token_id or 0)],
                                      request_id="__warmup__", max_new_tokens=1)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                result = self._manager.get_result(timeout=0.5)
                if result is not None and result.is_finished():
                    break

    def _collect_loop(self) -> None:
        """Take finished generations from the manager (continuous batching)."""
        while not self._stop:
            try:
                result = self._manager.get_result(timeout=_POLL_S * 5)
            except Exception:  # noqa: BLE001
                logger.exception("continuous batching failed")
                self._fail_running(RuntimeError("the continuous-batching manager failed"))
                return
            if result is None:
                if not self._manager.is_running() and not self._stop:
                    self._fail_running(RuntimeError("the continuous-batching generation thread stopped"))
                    return
                continue
            if not result.is_finished():
                with self._lock:
                    work = self._running.get(result.request_id)
                if work is not None and work.on_delta is not None and result.error is None:
                    self._stream(work, list(result.generated_tokens))
                continue
            with self._lock:
                work = self._running.pop(result.request_id, None)
            if work is None:  # warm-up, or aborted meanwhile
                continue
            if result.error is not None:
                self._fail(work, RuntimeError(f"AR generation failed: {result.error}"))
                continue
            eos = self.model.generation_config().eos_token_id
            work.generated = cut_at_eos(list(result.generated_tokens), eos)
            work.finished = time.perf_counter()
            self._hand_to_export([work])

    def _stream(self, work: _Work, tokens: list[int]) -> None:
        """Send the text `tokens` add to what `work` already streamed (the text is decoded
        whole, so a token that completes a multi-byte character is sent with it)."""
        text = self.model.text(tokens)
        if text is None or not text.startswith(work.text_so_far) or len(text) == len(work.text_so_far):
            return
        delta, work.text_so_far = text[len(work.text_so_far):], text
        try:
            work.on_delta(delta)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the stage
            logger.exception("AR text listener for %s raised", work.ar_input.request_id)

    def _fail_running(self, error: BaseException) -> None:
        with self._lock:
            works = list(self._running.values())
            self._running.clear()
        for work in works:
            self._fail(work, error)

    # ------------------------------------------------------------------ batched generate
    def _generate_loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stop:
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    return
                first = self._waiting[0]
                batch = [w for w in self._waiting if w.ar_input.group == first.ar_input.group][: self.max_batch]
                for work in batch:
                    self._waiting.remove(work)
                    self._running[work.ar_input.request_id] = work
            self._run_round(batch)

    def _run_round(self, batch: list[_Work]) -> None:
        start = time.perf_counter()
        for work in batch:
            work.started = start
        try:
            generated = self._generate(batch)
        except Exception as exc:  # noqa: BLE001
            if len(batch) == 1:
                self._finish_round(batch)
                self._fail(batch[0], RuntimeError(f"AR generation failed: {exc}"))
                return
            logger.warning("batched AR generation failed (%s); retrying %d requests alone", exc, len(batch))
            for work in batch:
                self._run_round([work])
            return
        end = time.perf_counter()
        self.counters["rounds"] += 1
        for work, tokens in zip(batch, generated):
            work.generated, work.finished = tokens, end
        self._finish_round(batch)
        self._hand_to_export([w for w in batch if w.ar_input.request_id not in self._aborted])

    def _generate(self, batch: list[_Work]) -> list[list[int]]:
        with torch.inference_mode():
            return self.model.generate([w.ar_input for w in batch])

    def _finish_round(self, batch: list[_Work]) -> None:
        with self._lock:
            for work in batch:
                self._running.pop(work.ar_input.request_id, None)

    # ------------------------------------------------------------------ payloads
    def _hand_to_export(self, works: list[_Work]) -> None:
        with self._lock:
            self._finished.extend(works)
            self._wake.notify_all()

    def _export_loop(self) -> None:
        """Make and put the payloads of every request that finished generating, in one batch."""
        while True:
            with self._lock:
                while not self._finished and not self._stop:
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    return
                batch = [w for w in self._finished if w.ar_input.request_id not in self._aborted]
                self._finished.clear()
            if batch:
                self._export(batch)

    def _export(self, batch: list[_Work]) -> None:
        start = time.perf_counter()
        try:
            with torch.inference_mode(), self._model_to_myself():
                products = self.model.products([w.ar_input for w in batch], [w.generated for w in batch])
        except Exception as exc:  # noqa: BLE001 - retry alone to isolate the failing request
            if len(batch) == 1:
                self._fail(batch[0], RuntimeError(f"AR payload export failed: {exc}"))
                return
            for work in batch:
                self._export([work])
            return
        for work, product in zip(batch, products):
            request_id = work.ar_input.request_id
            if isinstance(product, BaseException):
                self._fail(work, RuntimeError(f"AR payload export failed: {product}"))
                continue
            try:
                handle = self.connector.put(request_id, product.parts)
            except Exception as exc:  # noqa: BLE001
                self._fail(work, RuntimeError(f"putting the AR payload into the connector failed: {exc}"))
                continue
            end = time.perf_counter()
            done = ARDone(handle=handle, text=product.text, num_tokens=len(work.generated),
                          queue_s=(work.started or work.submitted) - work.submitted,
                          generate_s=(work.finished or end) - (work.started or work.submitted),
                          export_s=end - start, nbytes=handle.nbytes)
            if work.on_delta is not None and product.text is not None and product.text != work.text_so_far:
                delta = product.text[len(work.text_so_far):] if product.text.startswith(work.text_so_far) \
                    else product.text
                try:
                    work.on_delta(delta)
                except Exception:  # noqa: BLE001
                    logger.exception("AR text listener for %s raised", request_id)
            with self._lock:
                delivered = request_id not in self._aborted and not work.future.done()
                if delivered:
                    work.future.set_result(done)
                    self._inflight.discard(request_id)
                    self.counters["finished"] += 1
                    self.counters["tokens"] += done.num_tokens
                    self.counters["generate_s"] += done.generate_s
                    self.counters["export_s"] += done.export_s
            if not delivered:  # aborted while exporting: never handed on
                self.connector.free(request_id)
                self._fail(work, ARAbortedError(f"request {request_id!r} aborted during its AR stage"), aborted=True)

    def _model_to_myself(self) -> contextlib.AbstractContextManager:
        """Pause the continuous-batching loop for a forward of the same module on this thread.

        transformers' continuous-batching loop and a plain forward of the same module must not
        run at the same time: measured on the built-in model, 199 of 200 K/V exports run beside
        the loop came out wrong (max abs error 8.7), none with the loop paused
        (``ContinuousBatchingManager.pause`` waits for the loop to stop between two of its
        steps; it keeps its cache and requests)."""
        if self._manager is not None and self._manager.is_running():
            return self._manager.pause()
        return contextlib.nullcontext()

    def _fail(self, work: _Work, error: BaseException, aborted: bool = False) -> None:
        """Resolve `work`'s future with `error` (once: later calls for the same work do nothing)."""
        with self._lock:
            if work.future.done():
                return
            try:
                work.future.set_exception(error)
            except Exception:  # noqa: BLE001 - resolved meanwhile
                return
            self._inflight.discard(work.ar_input.request_id)
            self._aborted.discard(work.ar_input.request_id)
            self.counters["aborted" if aborted else "failed"] += 1
        if not aborted:
            logger.error("AR stage failed for %s: %s", work.ar_input.request_id, error)


__all__ = ["ARAbortedError", "ARDone", "ARStageRunner"]
