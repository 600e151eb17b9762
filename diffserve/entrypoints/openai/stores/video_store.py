"""Video jobs of ``POST /v1/videos`` and their files: a small store interface (`VideoStore`) and
an implementation on a local folder (`LocalVideoStore`) that several server replicas can share.

Promise (the url image store's): once a job ends it states ``expires_at``, and the job and its
video stay available until then, always. Nothing is evicted early to make room: a job reserves
room for its video (`encoded_video_bound`) when it is created, and creation is refused when the
store is full (`StoreFullError`: HTTP 503 with ``Retry-After`` = seconds until the next job
expires), before any compute.

Bounds: at most `max_jobs` jobs (queued, running and ended but not expired) and `max_bytes` of
videos (stored, plus the reservations of unfinished jobs). A job expires `ttl_s` seconds after it
ended (completed or failed); expired jobs and their files are deleted by whichever replica next
looks.

Replicas: a job belongs to the replica that runs it (``owner``), which writes its progress and
renews its lease (``lease_until``) at least every `LEASE_S` / 4 seconds; every replica can read,
list, download and delete any job. Deleting a job that another replica runs makes that replica
abort it at its next update (`VideoStore.update` returns False). An unfinished job whose lease
ran out (its replica stopped) is reported as failed with code ``server_stopped``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: replicas in one process only
    fcntl = None  # type: ignore[assignment]

from diffserve.entrypoints.openai.stores.image_store import StoreFullError
from diffserve.core.errors import InvalidRequestError

#: Default seconds a job and its video stay available after the job ended.
DEFAULT_TTL_S = 3600.0
#: Default most jobs kept (unfinished and ended).
DEFAULT_MAX_JOBS = 1000
#: Default most bytes of videos (stored and reserved), 4 GiB.
DEFAULT_MAX_BYTES = 4 * 2**30
#: Seconds an unfinished job's lease lasts; its replica renews it well before.
LEASE_S = 60.0
#: Job statuses (OpenAI's): unfinished ones first.
ACTIVE_STATUSES = ("queued", "in_progress")
STATUSES = ACTIVE_STATUSES + ("completed", "failed")
#: Video ids: ``video_`` + 12 hex digits of the creation time in ms + 20 random hex digits, so
#: ids sort by creation time.
#: What `new_video_id` makes: ``video_`` + 12 hex digits of milliseconds + 20 random hex digits
#: (match with ``fullmatch``).
VIDEO_ID = re.compile(r"video_[0-9a-f]{32}")


def new_video_id(now: float | None = None) -> str:
    """A fresh job id that sorts after the ids made earlier (millisecond clock + 80 random bits)."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"video_{ms:012x}{secrets.token_hex(10)}"


def encoded_video_bound(num_frames: int, width: int, height: int) -> int:
    """Upper bound in bytes of the H.264 MP4 of `num_frames` frames of `width` x `height`
    pixels: the raw RGB frames plus 10% and 64 KiB of container."""
    return math.ceil(num_frames * width * height * 3 * 1.1) + 65536


@dataclass
class VideoJob:
    """One video job (plain data, stored as JSON).

    Times are Unix seconds (wall clock: replicas share them). ``reserved_bytes`` is the room
    held for the video until it is stored (then ``content_bytes``). ``error_code`` /
    ``error_message`` are set when failed; ``timings`` (stage seconds) and the truncation
    flags when completed.
    """

    id: str
    created_at: float
    model: str
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    num_inference_steps: int
    reserved_bytes: int
    owner: str
    status: str = "queued"
    steps_done: int = 0
    queue_position: int | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    error_code: str | None = None
    error_message: str | None = None
    timings: dict[str, Any] | None = None
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    content_bytes: int = 0
    media_type: str = "video/mp4"
    lease_until: float = 0.0

    @property
    def active(self) -> bool:
        """Queued or in progress."""
        return self.status in ACTIVE_STATUSES

    @property
    def held_bytes(self) -> int:
        """Bytes this job counts against the store's bound."""
        if self.status == "completed":
            return self.content_bytes
        return self.reserved_bytes if self.active else 0

    def to_json(self) -> str:
        """The job as one line of JSON (what the store writes)."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "VideoJob":
        """A job from `to_json`'s text; unknown keys (written by a newer replica) are ignored.

        Raises:
            ValueError / TypeError: not a job's JSON.
        """
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


class VideoStore(ABC):
    """Where video jobs and their videos live (see the module docstring).

    Attributes:
        ttl_s: seconds a job stays available after it ended.
    """

    ttl_s: float

    @abstractmethod
    def create(self, job: VideoJob) -> None:
        """Store a new job, holding ``job.reserved_bytes`` for its video.

        Raises:
            StoreFullError: the job count or byte bound would be exceeded (until jobs expire).
            InvalidRequestError: the video alone exceeds the byte bound (field ``num_frames``).
        """

    @abstractmethod
    def get(self, job_id: str) -> VideoJob | None:
        """The job (None if unknown, malformed or expired); an unfinished job whose lease ran out
        comes back failed."""

    @abstractmethod
    def update(self, job: VideoJob) -> bool:
        """Write an unfinished job's progress and renew its lease (sets ``lease_until``).

        Returns:
            False when the job no longer exists (deleted): its owner should abort it.
        """

    @abstractmethod
    def finish(self, job: VideoJob, content: bytes | None) -> bool:
        """End a job: with `content` (the video) as completed, else as failed (set ``status``,
        ``error_*``, ``timings`` on `job` first). Sets ``completed_at`` and ``expires_at``.

        Returns:
            False when the job no longer exists (deleted meanwhile; nothing is stored).

        Raises:
            ValueError: `content` is larger than the job's reservation.
        """

    @abstractmethod
    def open_content(self, job_id: str) -> tuple[VideoJob, BinaryIO | None] | None:
        """The job and an open binary file of its video (None while it has none), or None if
        the job is unknown or expired. The caller closes the file."""

    @abstractmethod
    def delete(self, job_id: str) -> VideoJob | None:
        """Delete a job and its video; returns it as it was, or None if unknown."""

    @abstractmethod
    def list(self, after: str | None = None, limit: int = 20, order: str = "desc") -> tuple[list[VideoJob], bool]:
        """Jobs by creation time (``order`` ``"asc"`` / ``"desc"``), starting after the job id
        `after` (which need not exist any more), at most `limit`.

        Returns:
            (jobs, whether more follow).
        """

    @abstractmethod
    def close(self) -> None:
        """Release the store (a private folder is deleted)."""


class LocalVideoStore(VideoStore):
    """A `VideoStore` in a folder: ``<id>.json`` per job and ``<id>.mp4`` per video, written
    atomically (temporary file + rename), changes serialised by an advisory file lock
    (``.lock``, ``fcntl.flock``) so that replicas on one machine, or on machines sharing the
    folder over a file system with working ``flock``, can share it.

    Args:
        root: the folder (created if missing; left in place at `close`, other replicas may use
            it); None = a private temporary folder, deleted at `close`.
        ttl_s: seconds a job stays available after it ended (> 0).
        max_jobs / max_bytes: bounds (>= 1).
        replica: this replica's id (recorded as the owner of the jobs it creates); default random.
        clock: wall clock in Unix seconds (injectable for tests).

    Raises:
        ValueError: a non-positive ttl or bound.
        OSError: the folder cannot be created.
    """

    def __init__(self, root: str | Path | None = None, ttl_s: float = DEFAULT_TTL_S, max_jobs: int = DEFAULT_MAX_JOBS,
                 max_bytes: int = DEFAULT_MAX_BYTES, replica: str | None = None,
                 clock: Callable[[], float] = time.time):
        if not ttl_s > 0 or max_jobs < 1 or max_bytes < 1:
            raise ValueError("ttl_s, max_jobs and max_bytes must be positive")
        self.ttl_s = float(ttl_s)
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.replica = replica or secrets.token_hex(8)
        self._clock = clock
        self._private = root is None
        self.root = Path(tempfile.mkdtemp(prefix="diffserve-videos-")) if root is None else Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / ".lock"
        self._thread_lock = threading.Lock()

    # ------------------------------------------------------------------------ interface
    def create(self, job: VideoJob) -> None:
        with self._locked():
            now = self._clock()
            jobs = self._sweep(now)
            if job.reserved_bytes > self.max_bytes:  # never fits: retrying cannot help
                raise InvalidRequestError("num_frames", job.num_frames, f"fewer frames or a smaller size: a video of "
                                          f"up to {job.reserved_bytes} bytes does not fit the server's video store "
                                          f"({self.max_bytes} bytes)")
            used = sum(j.held_bytes for j in jobs)
            if len(jobs) + 1 > self.max_jobs or used + job.reserved_bytes > self.max_bytes:
                ends = [j.expires_at for j in jobs if j.expires_at is not None]
                retry = max(1, math.ceil(min(ends) - now)) if ends else 1
                raise StoreFullError(f"the video store is full ({len(jobs)} of {self.max_jobs} jobs, {used} of "
                                     f"{self.max_bytes} bytes) until earlier jobs expire; retry later",
                                     retry_after_s=retry)
            job.owner = job.owner or self.replica
            job.lease_until = now + LEASE_S
            self._write_job(job)

    def get(self, job_id: str) -> VideoJob | None:
        job = self._read(job_id)
        if job is None:
            return None
        now = self._clock()
        if (job.expires_at is not None and job.expires_at <= now) or (job.active and job.lease_until <= now):
            with self._locked():  # expire it, or fail it: its replica stopped
                self._sweep_one(job_id, now)
                job = self._read(job_id)
        return job

    def update(self, job: VideoJob) -> bool:
        with self._locked():
            if not self._job_path(job.id).exists():
                return False
            job.lease_until = self._clock() + LEASE_S
            self._write_job(job)
            return True

    def finish(self, job: VideoJob, content: bytes | None) -> bool:
        if content is not None and len(content) > job.reserved_bytes:
            raise ValueError(f"video of {len(content)} bytes exceeds its reservation of {job.reserved_bytes}")
        with self._locked():
            if not self._job_path(job.id).exists():
                return False
            now = self._clock()
            if content is not None:
                self._atomic_write(self._content_path(job.id), content)
                job.status, job.content_bytes = "completed", len(content)
            elif job.status != "failed":
                job.status = "failed"
            job.queue_position = None
            job.completed_at = now
            job.expires_at = now + self.ttl_s
            self._write_job(job)
            return True

    def open_content(self, job_id: str) -> tuple[VideoJob, BinaryIO | None] | None:
        job = self.get(job_id)
        if job is None:
            return None
        if job.status != "completed":
            return job, None
        try:
            return job, open(self._content_path(job_id), "rb")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:  # deleted meanwhile
            return None

    def delete(self, job_id: str) -> VideoJob | None:
        if not VIDEO_ID.fullmatch(job_id):
            return None
        with self._locked():
            job = self._read(job_id)
            self._remove(job_id)
            return job

    def list(self, after: str | None = None, limit: int = 20, order: str = "desc") -> tuple[list[VideoJob], bool]:
        with self._locked():
            jobs = self._sweep(self._clock())
        jobs.sort(key=lambda j: j.id, reverse=order == "desc")  # ids sort by creation time
        if after is not None:
            jobs = [j for j in jobs if (j.id < after if order == "desc" else j.id > after)]
        return jobs[:limit], len(jobs) > limit

    def close(self) -> None:
        if self._private:
            shutil.rmtree(self.root, ignore_errors=True)

    def stats(self) -> dict[str, int]:
        """Counts: jobs, active (unfinished) jobs, bytes held (stored + reserved)."""
        with self._locked():
            jobs = self._sweep(self._clock())
        return {"jobs": len(jobs), "active": sum(j.active for j in jobs), "bytes": sum(j.held_bytes for j in jobs)}

    # ------------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            if fcntl is None:
                yield
                return
            with open(self._lock_path, "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def _job_path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.json"

    def _content_path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.mp4"

    def _read(self, job_id: str) -> VideoJob | None:
        if not VIDEO_ID.fullmatch(job_id):
            return None
        try:
            return VideoJob.from_json(self._job_path(job_id).read_text())
        except (OSError, ValueError, TypeError):
            return None

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _write_job(self, job: VideoJob) -> None:
        self._atomic_write(self._job_path(job.id), job.to_json().encode())

    def _remove(self, job_id: str) -> None:
        self._job_path(job_id).unlink(missing_ok=True)
        self._content_path(job_id).unlink(missing_ok=True)

    def _sweep_one(self, job_id: str, now: float) -> VideoJob | None:
        """Apply expiry and lease rules to one job (lock held); returns it, or None if gone."""
        job = self._read(job_id)
        if job is None:
            return None
        if job.expires_at is not None and job.expires_at <= now:
            self._remove(job_id)
            return None
        if job.active and job.lease_until <= now:
            job.status, job.queue_position = "failed", None
            job.error_code = "server_stopped"
            job.error_message = "the server replica running this job stopped before it finished"
            job.completed_at = job.lease_until
            job.expires_at = job.lease_until + self.ttl_s
            self._write_job(job)
        return job

    def _sweep(self, now: float) -> list[VideoJob]:
        """Every live job, after deleting expired ones (lock held)."""
        jobs = []
        for path in self.root.glob("video_*.json"):
            job = self._sweep_one(path.stem, now)
            if job is not None:
                jobs.append(job)
        for path in self.root.glob("video_*.mp4"):  # a video whose job is gone
            if not self._job_path(path.stem).exists():
                path.unlink(missing_ok=True)
        return jobs
