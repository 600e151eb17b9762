"""The request scheduler's queue policy (`RequestQueues`): admission, batch choice, fairness,
queue bound."""

from __future__ import annotations

import pytest

from diffserve import EngineOverloadedError
from diffserve.engine.queues import RequestQueues
from diffserve.engine.request import Phase, Request


def _req(seq, key="a", rows=2):
    return Request(request_id=str(seq), prompt="p", params=None, batch_key=key, rows=rows, seq=seq,
                   arrival_time=0.0)


def _admit(s: RequestQueues) -> list[Request]:
    """Admit, then mark the admitted requests prepared (what the engine does once their
    prepare work comes back): only denoising requests are stepped."""
    admitted = s.admit()
    for r in admitted:
        r.phase = Phase.DENOISING
    s.changed()
    return admitted


def test_steps_only_denoising_requests():
    s = RequestQueues(max_batch_size=6, max_waiting=10)
    for i in range(3):
        s.add(_req(i))
    admitted = s.admit()
    assert s.select_batch() == [] and s.running_rows == 6  # preparing: holds rows, not stepped
    admitted[1].phase = Phase.DENOISING
    admitted[2].phase = Phase.DECODING
    s.changed()
    assert s.select_batch() == [admitted[1]] and s.running_rows == 4  # decoding frees its rows


def test_batches_oldest_key_and_admits_fifo():
    s = RequestQueues(max_batch_size=6, max_waiting=10)
    for i, key in enumerate("abaa"):
        s.add(_req(i, key))
    admitted = _admit(s)
    assert [r.request_id for r in admitted] == ["0", "1", "2"]  # 6 rows: "3" must wait
    assert [r.request_id for r in s.select_batch()] == ["0", "2"]  # oldest's key "a"
    s.finish(admitted[0])
    assert [r.request_id for r in _admit(s)] == ["3"]
    assert [r.request_id for r in s.select_batch()] == ["1"]  # "b" is now the oldest running


def test_batches_by_step_key_too():
    """A request's step key (e.g. Wan 2.2's expert) changes while it runs; only requests of
    the oldest's (batch key, step key) share a step."""
    s = RequestQueues(max_batch_size=8, max_waiting=10)
    for i in range(3):
        s.add(_req(i))
    r0, r1, r2 = _admit(s)
    r1.step_key = 1
    s.changed()
    assert s.select_batch() == [r0, r2]
    r0.step_key = 1  # the oldest crossed to the other expert
    s.changed()
    assert s.select_batch() == [r0, r1]


def test_reuses_its_batch_until_something_changes():
    """An unchanged batch is returned as the same list (no per-request work per step); an
    admission, a finish or `changed` (a phase or step key moved) makes it select again."""
    s = RequestQueues(max_batch_size=4, max_waiting=10)
    for i in range(3):
        s.add(_req(i))
    r0, r1 = _admit(s)
    batch = s.select_batch()
    assert batch == [r0, r1] and s.select_batch() is batch
    r1.phase = Phase.DECODING
    assert s.select_batch() is batch  # not told: the engine calls `changed` after such a move
    s.changed()
    assert s.select_batch() == [r0]
    s.finish(r1)
    [r2] = _admit(s)
    assert s.select_batch() == [r0, r2]
    s.finish(r0)
    assert s.select_batch() == [r2]


def test_queue_bound():
    s = RequestQueues(max_batch_size=2, max_waiting=2)
    s.add(_req(0))
    s.add(_req(1))
    with pytest.raises(EngineOverloadedError):
        s.add(_req(2))


def test_no_request_starves_under_adversarial_arrivals():
    """A lone key-"b" request arrives behind a steady stream of key-"a" requests that would
    always form the bigger batch; it must still finish within a bounded number of steps."""
    s = RequestQueues(max_batch_size=8, max_waiting=1000)
    steps_left, seq = {}, 0

    def arrive(key):
        nonlocal seq
        r = _req(seq, key)
        s.add(r)
        steps_left[r.request_id] = 5
        seq += 1
        return r

    for _ in range(4):
        arrive("a")
    victim = arrive("b")
    done_at = None
    for step in range(200):
        for _ in range(2):
            arrive("a")  # adversary: more "a" work every step
        _admit(s)
        for r in s.select_batch():
            steps_left[r.request_id] -= 1
            if steps_left[r.request_id] == 0:
                s.finish(r)
                if r is victim:
                    done_at = step
        if done_at is not None:
            break
    assert done_at is not None and done_at < 20
