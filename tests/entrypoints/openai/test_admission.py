"""Fair admission under a full waiting queue (`services.admission.AdmissionLine`): room that
frees goes to the requests refused first, so a client that retries after ``Retry-After`` is
not starved by fresh arrivals; clients that gave up lose their place."""

from __future__ import annotations

from diffserve.entrypoints.openai.errors import RETRY_AFTER_S
from diffserve.entrypoints.openai.services.admission import (
    HOLD_S,
    LINE_TTL_S,
    MAX_LINE,
    AdmissionLine,
    request_fingerprint,
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_retrying_client_is_not_starved_by_fresh_arrivals():
    """The hostile trial's case: one client retries after each Retry-After while fresh requests
    arrive every 0.1 s; one slot frees now and then. Greedy admission let the fresh requests
    take every slot; the line gives the first freed slot to the retrying client."""
    clock = Clock()
    line = AdmissionLine(clock)
    assert not line.admit("retrying", 1, free=0)
    admitted_at = None
    fresh = free = 0
    for tick in range(1, 100):  # 0.1 s per tick
        clock.now = tick / 10
        if tick == 7:
            free = 1  # a slot frees at 0.7 s and stays free until a request takes it
        if tick % (10 * RETRY_AFTER_S) == 0 and line.admit("retrying", 1, free):
            admitted_at = clock.now
            break
        fresh += 1
        assert not line.admit(f"fresh-{fresh}", 1, free), f"a fresh request took the held slot at {clock.now}"
    assert admitted_at == RETRY_AFTER_S  # its first retry after the slot freed
    # the fresh requests queue up behind it, first refused first served
    clock.now += 0.1
    assert line.admit("fresh-1", 1, free=1) and not line.admit("fresh-9", 1, free=1)


def test_room_beyond_the_held_room_admits_anyone_and_untracked_requests_wait():
    clock = Clock()
    line = AdmissionLine(clock)
    assert not line.admit("a", 2, free=1)  # needs 2: in line
    assert not line.admit("b", 1, free=1)  # the one free slot is held for "a" (first refused)
    assert not line.admit(None, 1, free=3)  # 3 held: 2 for "a", 1 for "b" (untracked: no place taken)
    assert line.admit("d", 1, free=4)  # 1 beyond the held room
    assert line.admit("b", 1, free=2) is False  # "a" first
    assert line.admit("a", 2, free=2)
    assert line.admit("b", 1, free=1) and len(line) == 0


def test_clients_that_gave_up_lose_their_place():
    clock = Clock()
    line = AdmissionLine(clock)
    assert not line.admit("gone", 1, free=0)
    assert not line.admit("waiting", 1, free=0)
    clock.now = 1.0
    assert not line.admit("waiting", 1, free=1)  # the slot is held for "gone" from now on
    clock.now = 1.0 + HOLD_S + 0.1  # "gone" did not come back within HOLD_S
    assert line.admit("waiting", 1, free=1)
    assert not line.admit("idle", 1, free=0)
    clock.now += LINE_TTL_S + 0.1  # never retried: no place kept
    assert line.admit("new", 1, free=1) and len(line) == 0


def test_the_line_is_bounded_and_fingerprints_identify_a_retry():
    line = AdmissionLine(Clock())
    for i in range(MAX_LINE + 10):
        assert not line.admit(str(i), 1, free=0)
    assert len(line) == MAX_LINE
    one = request_fingerprint("10.0.0.1", "/v1/images/edits", '{"prompt":"x"}', [b"\x01" * 32])
    assert one == request_fingerprint("10.0.0.1", "/v1/images/edits", '{"prompt":"x"}', [b"\x01" * 32])
    for other in (request_fingerprint("10.0.0.2", "/v1/images/edits", '{"prompt":"x"}', [b"\x01" * 32]),
                  request_fingerprint("10.0.0.1", "/v1/videos", '{"prompt":"x"}', [b"\x01" * 32]),
                  request_fingerprint("10.0.0.1", "/v1/images/edits", '{"prompt":"y"}', [b"\x01" * 32]),
                  request_fingerprint("10.0.0.1", "/v1/images/edits", '{"prompt":"x"}', [b"\x02" * 32])):
        assert other != one
