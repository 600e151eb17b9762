"""`LocalVideoStore`: bounds (count, bytes), stated expiries that always hold, leases, and two
replicas sharing one folder."""

from __future__ import annotations

import pytest

from diffserve.core.errors import InvalidRequestError
from diffserve.entrypoints.openai.stores.image_store import StoreFullError
from diffserve.entrypoints.openai.stores.video_store import LEASE_S, LocalVideoStore, VideoJob, new_video_id


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def job(clock: Clock, reserved: int = 100, **fields) -> VideoJob:
    return VideoJob(id=new_video_id(clock.now), created_at=clock.now, model="m", prompt="p", width=16, height=16,
                    num_frames=9, fps=8, seed=0, num_inference_steps=4, reserved_bytes=reserved, owner="", **fields)


def test_ids_sort_by_creation_time_and_only_well_formed_ids_are_read(tmp_path):
    assert new_video_id(1.0) < new_video_id(1.002) < new_video_id(2.0)
    store = LocalVideoStore(tmp_path)
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "secret", "video_../../x", "video_" + "g" * 32):
        assert store.get(bad) is None and store.delete(bad) is None and store.open_content(bad) is None


def test_count_and_byte_bounds_refuse_new_jobs_until_the_oldest_expire(tmp_path):
    clock = Clock()
    store = LocalVideoStore(tmp_path, ttl_s=100, max_jobs=2, max_bytes=1000, clock=clock)
    first, second = job(clock, 600), job(clock, 300)
    store.create(first)
    store.create(second)
    with pytest.raises(StoreFullError):  # a third job: over the count
        store.create(job(clock, 10))
    assert store.finish(first, b"x" * 50)  # stored: holds its 50 bytes, not its 600 reserved
    first_expiry = first.expires_at
    assert first_expiry == clock.now + 100
    clock.now += 10
    second.status, second.error_code, second.error_message = "failed", "generation_failed", "boom"
    assert store.finish(second, None)
    with pytest.raises(StoreFullError) as info:
        store.create(job(clock, 10))
    assert info.value.retry_after_s == 90  # until the first job expires
    clock.now = first_expiry - 0.001  # the stated expiry holds to the end
    got = store.get(first.id)
    assert got.status == "completed" and store.open_content(first.id)[1].read() == b"x" * 50
    clock.now = first_expiry
    assert store.get(first.id) is None and not (tmp_path / f"{first.id}.mp4").exists()
    store.create(job(clock, 10))
    with pytest.raises(InvalidRequestError, match="does not fit"):  # larger than the whole store: never fits (400)
        LocalVideoStore(tmp_path / "b", max_bytes=1000, clock=clock).create(job(clock, 2000))


def test_finish_refuses_a_video_over_its_reservation(tmp_path):
    store = LocalVideoStore(tmp_path)
    j = job(Clock(), reserved=10)
    store.create(j)
    with pytest.raises(ValueError, match="reservation"):
        store.finish(j, b"x" * 11)


def test_replicas_share_jobs_and_a_delete_reaches_the_owner(tmp_path):
    clock = Clock()
    a = LocalVideoStore(tmp_path, clock=clock, replica="a")
    b = LocalVideoStore(tmp_path, clock=clock, replica="b")
    j = job(clock)
    a.create(j)
    assert j.owner == "a"
    j.status, j.steps_done = "in_progress", 2
    assert a.update(j)
    seen = b.get(j.id)
    assert (seen.status, seen.steps_done, seen.owner) == ("in_progress", 2, "a")
    assert [x.id for x in b.list()[0]] == [j.id]
    assert b.delete(j.id).id == j.id
    assert not a.update(j)  # the owner learns at its next write, and aborts the job
    assert not a.finish(j, b"video") and not (tmp_path / f"{j.id}.mp4").exists()


def test_an_unfinished_job_whose_replica_stopped_is_failed_after_its_lease(tmp_path):
    clock = Clock()
    owner = LocalVideoStore(tmp_path, ttl_s=50, clock=clock)
    j = job(clock)
    owner.create(j)
    clock.now += LEASE_S - 1
    assert LocalVideoStore(tmp_path, clock=clock).get(j.id).status == "queued"
    clock.now += 2  # the owner never renewed its lease
    other = LocalVideoStore(tmp_path, ttl_s=50, clock=clock)
    failed = other.get(j.id)
    assert (failed.status, failed.error_code) == ("failed", "server_stopped")
    assert failed.expires_at == j.created_at + LEASE_S + 50
    assert other.stats() == {"jobs": 1, "active": 0, "bytes": 0}  # its reservation is released


def test_list_orders_and_pages_by_creation_time(tmp_path):
    clock = Clock()
    store = LocalVideoStore(tmp_path, clock=clock)
    ids = []
    for _ in range(5):
        j = job(clock)
        store.create(j)
        ids.append(j.id)
        clock.now += 1
    page, more = store.list(limit=2)
    assert [j.id for j in page] == ids[::-1][:2] and more
    page, more = store.list(after=page[-1].id, limit=10)
    assert [j.id for j in page] == ids[::-1][2:] and not more
    page, _ = store.list(after=ids[1], order="asc")
    assert [j.id for j in page] == ids[2:]
    store.delete(ids[2])
    page, _ = store.list(after=ids[2], order="asc")  # paging goes on after a deleted id
    assert [j.id for j in page] == ids[3:]


def test_a_private_store_deletes_its_folder_and_a_shared_one_stays(tmp_path):
    private = LocalVideoStore()
    folder = private.root
    private.create(job(Clock()))
    private.close()
    assert not folder.exists()
    shared = LocalVideoStore(tmp_path / "shared")
    shared.create(job(Clock()))
    shared.close()
    assert len(list((tmp_path / "shared").glob("video_*.json"))) == 1
