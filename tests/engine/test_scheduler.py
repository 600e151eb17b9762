"""The request scheduler's lifecycle without a model (vLLM's ``tests/v1/core`` style): each test
drives `RequestScheduler.schedule()` / `update_from_output()` with fake runner outputs (the plain
`core.messages` a worker would send back) and checks the scheduler outputs, the events and the
metrics: admission, prepare, steps booked once per unchanged batch, previews, finishing, chunk
boundaries and interactions, aborts and failures in every phase, the whole-request runner's
per-request step counts, step keys, and frees."""

from __future__ import annotations

import pytest

from diffserve.core.errors import InteractionRefusedError
from diffserve.core.messages import (
    ChunkDone,
    Decoded,
    Interaction,
    ModelInfo,
    Prepared,
    RequestPlan,
    RunnerOutput,
    StepOutput,
    WorkError,
)
from diffserve.core.outputs import EventType, RequestStatus
from diffserve.core.sampling_params import ModelSpec, SamplingParams
from diffserve.engine.input_processor import ProcessedRequest
from diffserve.engine.queues import RequestQueues
from diffserve.engine.request import Phase
from diffserve.engine.scheduler import RequestScheduler

SPEC = ModelSpec(resolution_factor=8, default_height=64, default_width=64, default_num_inference_steps=4,
                 default_guidance_scale=4.0, pipeline="FakePipeline", default_num_frames=None)


class Harness:
    """A scheduler, its events, and a fake worker's bookkeeping of what it holds."""

    def __init__(self, max_batch_size: int = 16, chunk_streaming: bool = True, video: bool = False, **queue_kw):
        spec = SPEC if not video else ModelSpec(**{**SPEC.__dict__, "default_num_frames": 5})
        info = ModelInfo(spec=spec, pipeline="FakePipeline", chunk_streaming=chunk_streaming)
        self.notified = 0
        self.scheduler = RequestScheduler(RequestQueues(max_batch_size, 100, **queue_kw), info,
                                          peak_memory_bytes=lambda: 123, notify=self._notify)
        self.held: set[str] = set()  # request ids the fake worker holds state for

    def _notify(self):
        self.notified += 1

    def add(self, request_id, steps=3, rows=2, key="a", num_chunks=None, **kw) -> str:
        params = SamplingParams(seed=7, num_inference_steps=steps, num_chunks=num_chunks)
        processed = ProcessedRequest("p", params, None, RequestPlan(rows=rows, batch_key=key, num_steps=steps))
        return self.scheduler.add_request(processed, request_id, **kw)

    def tick(self, result: RunnerOutput | None = None):
        """schedule(), then apply `result` (default: nothing came back and nothing stepped)."""
        out = self.scheduler.schedule()
        self.held -= set(out.finished_ids)
        self.held |= {n.request_id for n in out.new_requests}
        self.scheduler.update_from_output(out, result or RunnerOutput())
        return out

    def events(self):
        return [(e.request_id, e.type.value, e.step) for e in self.scheduler.take_events()]


def step_result(rows=2, **kw) -> RunnerOutput:
    return RunnerOutput(step=StepOutput(num_rows=rows, **kw), step_start=1.0, step_end=2.0)


def prepared(*ids, steps=3, **kw) -> RunnerOutput:
    return RunnerOutput(prepared=[Prepared(i, num_steps=steps, seconds=0.5, **kw) for i in ids])


def test_a_request_from_queued_to_finished():
    h = Harness()
    h.add("a")
    assert h.events() == [("a", "queued", None)] and h.scheduler.num_waiting == 1
    out = h.scheduler.schedule()  # admission: its prepare goes out with its inputs
    assert [n.request_id for n in out.new_requests] == ["a"] and not out.step_ids
    assert out.new_requests[0].params.seed == 7
    h.scheduler.update_from_output(out, prepared("a"))
    assert h.events() == [("a", "started", 0)]
    assert h.scheduler.requests["a"].phase is Phase.DENOISING and h.scheduler.num_running == 1
    for step in (1, 2, 3):
        out = h.scheduler.schedule()
        assert out.step_ids == ["a"] and not out.has_work
        h.scheduler.update_from_output(out, step_result())
        assert h.events() == [("a", "progress", step)]
    out = h.tick()  # done denoising: the decode goes out, nothing steps
    assert out.decodes == ["a"] and not out.step_ids and h.scheduler.requests["a"].phase is Phase.DECODING
    h.tick(RunnerOutput(decoded=[Decoded("a", output=["image"], step=3, seconds=0.25)]))
    [final] = h.scheduler.take_events()
    assert final.type is EventType.FINISHED and final.output.images == ["image"] and final.output.seed == 7
    m = final.output.metrics
    assert (m.num_steps, m.batch_sizes, m.encode_s, m.decode_s, m.peak_memory_bytes) == (3, {2: 3}, 0.5, 0.25, 123)
    assert not h.scheduler.has_unfinished_requests() and h.scheduler.num_running == 0


def test_an_unchanged_batch_is_the_same_object_every_tick_and_booked_once():
    """No per-request work per step: the same id list goes out every tick; steps are folded into
    the requests when the batch changes (here: `b` finishes first)."""
    h = Harness()
    h.add("a", steps=5)
    h.add("b", steps=2, progress=False)
    h.tick(prepared("a", steps=5))
    h.tick(prepared("b", steps=2))
    h.events()
    first = h.scheduler.schedule()
    h.scheduler.update_from_output(first, step_result(rows=4))
    second = h.scheduler.schedule()
    assert second.step_ids is first.step_ids == ["a", "b"]
    assert h.scheduler.requests["a"].steps_done == 0  # not booked yet: the run is still going
    h.scheduler.update_from_output(second, step_result(rows=4))
    assert h.scheduler.requests["b"].phase is Phase.DECODING  # the run ended where b finished
    assert [e for e in h.events() if e[0] == "b"] == []  # b asked for no progress events
    third = h.scheduler.schedule()
    assert third.step_ids == ["a"] and third.step_ids is not first.step_ids and third.decodes == ["b"]
    h.scheduler.update_from_output(third, step_result(rows=2))
    assert h.scheduler.requests["a"].metrics.batch_sizes == {4: 2}  # the new run is not folded yet
    for _ in range(2):
        h.tick(step_result(rows=2))
    h.tick()
    h.tick(RunnerOutput(decoded=[Decoded("a", output=[1]), Decoded("b", output=[2])]))
    finals = {e.request_id: e.output for e in h.scheduler.take_events() if e.type.is_final}
    assert finals["a"].metrics.batch_sizes == {4: 2, 2: 3} and finals["a"].metrics.num_steps == 5
    assert finals["b"].metrics.batch_sizes == {4: 2} and finals["b"].metrics.num_steps == 2


def test_previews_go_out_at_their_step_and_come_back_as_partial_events():
    h = Harness()
    h.add("a", steps=4, preview_steps=[2])
    h.tick(prepared("a", steps=4))
    h.tick(step_result())
    out = h.tick(step_result())
    assert not out.previews
    out = h.tick(step_result())  # the preview of step 2 goes out with step 3
    assert out.previews == ["a"] and out.step_ids == ["a"]
    h.tick(RunnerOutput(step=StepOutput(num_rows=2), decoded=[Decoded("a", output=["p"], step=2, preview=True)]))
    partial = [e for e in h.scheduler.take_events() if e.type is EventType.PARTIAL]
    assert [(e.step, e.preview) for e in partial] == [(2, ["p"])]
    assert h.scheduler.requests["a"].phase is Phase.DECODING


def test_aborts_of_waiting_and_preparing_requests():
    h = Harness(max_batch_size=2)
    for request_id in "wq":
        h.add(request_id, steps=2)
    h.tick()  # admits w (its 2 rows fill the batch); q waits
    assert h.scheduler.abort("q")  # waiting: closed at once, nothing to free
    assert h.scheduler.requests.get("q") is None
    assert h.scheduler.abort("w")  # preparing: closed when its prepare comes back
    out = h.tick(prepared("w", steps=2))
    assert "w" not in h.scheduler.requests and "w" not in out.finished_ids
    out = h.scheduler.schedule()  # the free of the aborted, prepared `w` goes out now
    assert out.finished_ids == ["w"]
    h.scheduler.update_from_output(out, RunnerOutput())
    finals = {e.request_id: e.type for e in h.scheduler.take_events() if e.type.is_final}
    assert finals == {"q": EventType.ABORTED, "w": EventType.ABORTED}
    assert not h.scheduler.abort("w") and not h.scheduler.abort("nope")


def test_a_denoising_request_aborted_leaves_at_the_next_schedule_and_is_freed():
    h = Harness()
    h.add("a", steps=9)
    h.add("b", steps=9)
    h.tick(prepared("a", "b", steps=9))
    h.tick(step_result(rows=4))
    h.scheduler.abort("a")
    out = h.scheduler.schedule()
    assert out.finished_ids == ["a"] and out.step_ids == ["b"]
    final = [e for e in h.scheduler.take_events() if e.request_id == "a" and e.type.is_final]
    assert final[0].type is EventType.ABORTED and final[0].output.metrics.num_steps == 1


def test_an_abort_during_decode_wins_over_the_output():
    h = Harness()
    h.add("a", steps=1)
    h.tick(prepared("a", steps=1))
    h.tick(step_result())
    h.tick()  # decode goes out
    assert h.scheduler.abort("a")
    h.tick(RunnerOutput(decoded=[Decoded("a", output=["image"])]))
    [final] = [e for e in h.scheduler.take_events() if e.type.is_final]
    assert final.type is EventType.ABORTED and final.output.images == []


@pytest.mark.parametrize("where", ["prepare", "step", "decode", "work"])
def test_a_failure_is_its_requests_alone(where):
    h = Harness()
    h.add("ok", steps=1)
    h.add("bad", steps=1)
    error = WorkError("RuntimeError", f"injected {where} failure")
    if where == "prepare":
        h.tick(RunnerOutput(prepared=[Prepared("ok", num_steps=1), Prepared("bad", error=error)]))
    elif where == "work":  # the whole prepare item raised (e.g. a dead worker): both fail, both freed
        h.tick(RunnerOutput(failed=[(["ok", "bad"], error)]))
        assert h.scheduler.schedule().finished_ids == ["ok", "bad"]
    else:
        h.tick(prepared("ok", "bad", steps=1))
        if where == "step":
            h.tick(step_result(rows=4, errors={"bad": error}))
        else:
            h.tick(step_result(rows=4))
            h.tick()
            h.tick(RunnerOutput(decoded=[Decoded("ok", output=[1]), Decoded("bad", error=error)]))
    h.tick()
    h.tick(RunnerOutput(decoded=[Decoded("ok", output=[1])]))
    finals = {e.request_id: e.output for e in h.scheduler.take_events() if e.type.is_final}
    assert finals["bad"].status is RequestStatus.FAILED and finals["bad"].error == f"RuntimeError: injected {where} failure"
    assert finals["bad"].error_type == "RuntimeError"
    assert finals["ok"].status is (RequestStatus.FAILED if where == "work" else RequestStatus.FINISHED)
    assert not h.scheduler.requests


def test_a_result_for_a_request_closed_meanwhile_is_freed():
    h = Harness()
    h.add("a")
    h.tick()
    h.scheduler.fail_all("the engine broke")
    assert h.scheduler.schedule().finished_ids == ["a"]
    h.scheduler.update_from_output(h.scheduler.schedule(), prepared("a"))  # its prepare was in flight
    assert h.scheduler.schedule().finished_ids == ["a"]


def test_whole_request_outputs_are_booked_per_request():
    """The whole-request runner reports each request's own step count and total (img2img
    strength): booked request by request, with one progress event per step."""
    h = Harness()
    h.add("a", steps=10)
    h.tick(prepared("a", steps=10))
    h.tick(step_result(rows=1, steps_done={"a": 1}, num_steps={"a": 6}))
    h.tick(step_result(rows=1, steps_done={"a": 6}, num_steps={"a": 6}))
    events = [e for e in h.scheduler.take_events() if e.type is EventType.PROGRESS]
    assert [(e.step, e.total) for e in events] == [(1, 6), (6, 6)]
    assert h.tick().decodes == ["a"]


def test_a_step_key_change_splits_the_batch():
    """Wan 2.2's expert: a request whose step key moves leaves the others' batch."""
    h = Harness()
    h.add("a", steps=9)
    h.add("b", steps=9)
    h.tick(prepared("a", "b", steps=9, step_key="high"))
    h.tick(step_result(rows=4, step_keys={"a": "low", "b": "high"}))
    assert h.scheduler.schedule().step_ids == ["a"]  # the oldest's key only


def test_chunk_boundaries_carry_interactions_and_stream_chunks():
    h = Harness(video=True)
    h.add("s", steps=1, num_chunks=3)
    h.tick(prepared("s", steps=1))
    with pytest.raises(InteractionRefusedError) as refused:
        h.scheduler.submit_interaction("nope", Interaction("x", 0, "e0"))
    assert refused.value.reason == "unknown_request"
    h.scheduler.submit_interaction("s", Interaction("a cat", 1, "e1"))
    h.tick(step_result())
    out = h.tick()
    assert [(w.request_id, [i.event_id for i in w.interactions]) for w in out.chunks] == [("s", ["e1"])]
    assert h.scheduler.requests["s"].phase is Phase.BETWEEN_CHUNKS
    # chunk 1 is being prepared already: an interaction now applies from chunk 2 on
    assert h.scheduler.submit_interaction("s", Interaction("a dog", 0, "e2")) == "e2"
    h.tick(RunnerOutput(chunks=[ChunkDone("s", chunk_index=0, frames="f0", event_ids=["e1"], num_steps=2)]))
    request = h.scheduler.requests["s"]
    assert (request.phase, request.chunk_index, request.num_steps, request.steps_done) == (Phase.DENOISING, 1, 2, 0)
    for _ in range(2):
        h.tick(step_result())
    assert [[i.event_id for i in w.interactions] for w in h.tick().chunks] == [["e2"]]
    h.tick(RunnerOutput(chunks=[ChunkDone("s", chunk_index=1, frames="f1", num_steps=1)]))
    with pytest.raises(InteractionRefusedError) as refused:  # chunk 2 runs now and is the last
        h.scheduler.submit_interaction("s", Interaction("a bird", 0, "e3"))
    assert refused.value.reason == "last_chunk"
    h.tick(step_result())
    h.tick()
    h.tick(RunnerOutput(chunks=[ChunkDone("s", chunk_index=2, frames="f2", video="whole")]))
    events = h.scheduler.take_events()
    chunks = [(e.chunk_index, e.output, e.event_ids) for e in events if e.type is EventType.CHUNK]
    assert chunks == [(0, "f0", ["e1"]), (1, "f1", []), (2, "f2", [])]
    [final] = [e for e in events if e.type.is_final]
    assert final.output.videos == ["whole"] and len(final.output.metrics.chunk_s) == 3
    progress = [(e.step, e.chunk_index) for e in events if e.type is EventType.PROGRESS]
    assert progress == [(1, 0), (1, 1), (2, 1), (1, 2)]
    with pytest.raises(InteractionRefusedError) as refused:
        h.scheduler.submit_interaction("s", Interaction("late", 0, "e4"))
    assert refused.value.reason == "finished"


def test_interactions_are_refused_for_requests_that_are_not_streams():
    h = Harness(chunk_streaming=False)
    h.add("a")
    with pytest.raises(InteractionRefusedError) as refused:
        h.scheduler.submit_interaction("a", Interaction("x", 0, "e"))
    assert refused.value.reason == "unsupported"


def test_events_go_to_listeners_and_wake_the_waiters_once_per_batch():
    h = Harness()
    got = []
    h.add("a", steps=2, listener=got.append)
    h.add("b", steps=2)
    h.tick(prepared("a", "b", steps=2))
    before = h.notified
    h.tick(step_result(rows=4))
    assert h.notified == before + 1  # one wake-up for the step's events
    assert [e.type for e in got] == [EventType.QUEUED, EventType.STARTED, EventType.PROGRESS]
    assert [e.request_id for e in h.scheduler.take_events() if e.type is EventType.PROGRESS] == ["b"]


def test_memory_admission_and_counts():
    h = Harness(memory_limit=10)
    for request_id in "abc":
        processed = ProcessedRequest("p", SamplingParams(seed=1), None, RequestPlan(rows=1, batch_key="k", num_steps=1),
                                     memory_bytes=4)
        h.scheduler.add_request(processed, request_id)
    out = h.scheduler.schedule()
    assert [n.request_id for n in out.new_requests] == ["a", "b"]  # 8 of 10 bytes; c would need 12
    assert (h.scheduler.num_waiting, h.scheduler.num_running, h.scheduler.num_running_rows) == (1, 2, 2)
    assert h.scheduler.queue_position("c") == 1 and h.scheduler.queue_position("a") is None


def test_fail_waiting_closes_a_waiting_request_only():
    """`fail_waiting` (a LoRA adapter that failed to load): the waiting request ends ``failed``
    with the error; a running one is left alone."""
    h = Harness(max_batch_size=2)
    h.add("a")
    h.add("b")
    h.tick()  # a admitted (2 rows); b waits
    h.events()
    assert not h.scheduler.fail_waiting("a", RuntimeError("no"))
    assert h.scheduler.fail_waiting("b", RuntimeError("adapter x failed"))
    [event] = h.scheduler.take_events()
    assert event.request_id == "b" and event.type is EventType.FAILED and "adapter x failed" in event.output.error
    assert h.scheduler.num_waiting == 0 and h.scheduler.num_running == 1


def _stepping_a(h: Harness, prepare_s: float = 0.01):
    """`a` admitted, prepared in `prepare_s` seconds and stepped once (a 1 s step)."""
    h.add("a", steps=5)
    h.tick(RunnerOutput(prepared=[Prepared("a", num_steps=5, seconds=prepare_s)]))
    h.tick(step_result())


def test_a_request_of_the_stepping_key_holds_one_step_for_its_prepare():
    """Join wait: the tick that admits a request able to join the stepping batch holds its step
    (bounded by JOIN_WAIT_FRACTION x the predicted step), so the newcomer's first step is the
    next forward, beside the running request."""
    h = Harness()
    _stepping_a(h)
    h.add("b", steps=3)
    held = h.scheduler.schedule()
    assert [n.request_id for n in held.new_requests] == ["b"] and held.step_ids == ()
    assert held.join_wait_s == pytest.approx(0.25 * 1.0)  # the cost model predicts the 1 s step
    h.scheduler.update_from_output(held, RunnerOutput(prepared=[Prepared("b", num_steps=3, seconds=0.01)]))
    assert h.scheduler.schedule().step_ids == ["a", "b"]
    assert h.scheduler.stats()["join_waits"] == 1


def test_a_join_wait_holds_at_most_every_other_tick():
    """Arrivals in every tick cannot starve the running batch: after a held tick the next one
    steps, whatever it admits."""
    h = Harness()
    _stepping_a(h)
    h.add("b", steps=3)
    assert h.tick().step_ids == ()  # held; b's prepare has not come back
    h.add("c", steps=3)
    out = h.tick(step_result())
    assert out.step_ids == ["a"] and out.join_wait_s == 0 and [n.request_id for n in out.new_requests] == ["c"]


@pytest.mark.parametrize("case", ["other key", "slow prepare", "off"])
def test_no_join_wait_when_the_newcomer_cannot_join_or_prepares_slowly(case):
    h = Harness()
    _stepping_a(h, prepare_s=0.3 if case == "slow prepare" else 0.01)  # 0.3 s > 0.25 x the 1 s step
    if case == "off":
        h.scheduler.join_wait_fraction = 0.0
    h.add("b", steps=3, key="other" if case == "other key" else "a")
    out = h.scheduler.schedule()
    assert out.step_ids == ["a"] and out.join_wait_s == 0 and [n.request_id for n in out.new_requests] == ["b"]
    assert h.scheduler.stats()["join_waits"] == 0
