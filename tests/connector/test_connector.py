"""The KV connector (`diffserve.connector`): payload packing, content-hash deduplication,
guidance branches as one unit, lifetimes, the in-process (no copy) and shared-memory (across
processes) implementations."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

from diffserve.connector import PayloadHandle, PayloadMissingError, make_connector
from diffserve.connector.handles import unpack_header
from diffserve.connector.inprocess import InProcessConnector
from diffserve.connector.payload import Payload, unpack
from diffserve.connector.shared_memory import SharedMemoryConnector, leaked_segments

PREFIX = "diffserve-test-"


def kv_payload(length: int, seed: int, dtype=torch.float32) -> Payload:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(length, 2, 2, 3, 4, generator=g).to(dtype)  # (L, layers, 2, H, D)
    return Payload("kv", {"kv": kv}, {"positions": [0, length], "num_layers": 2})


def test_pack_unpack_roundtrip_is_a_view_and_hash_follows_content():
    parts = Payload("kv", {"kv": torch.randn(5, 2, 2, 3, 4).bfloat16(), "ids": torch.arange(7),
                           "empty": torch.empty(0, 3)}, {"text": "seven"})
    buf = bytearray(parts.packed_size())
    copied = parts.pack_into(memoryview(buf))
    assert copied == parts.nbytes
    header, start = unpack_header(buf)
    assert header.digest == parts.digest and start % 64 == 0
    assert all(t.offset % 64 == 0 for t in header.tensors)
    back = unpack(buf)
    assert back.kind == "kv" and back.meta == {"text": "seven"} and back.digest == parts.digest
    for name, t in parts.tensors.items():
        assert back.tensors[name].dtype == t.dtype and torch.equal(back.tensors[name], t)
    back.tensors["ids"][0] = 42  # a view of the buffer, not a copy
    assert unpack(buf).tensors["ids"][0] == 42
    assert kv_payload(4, 0).digest == kv_payload(4, 0).digest != kv_payload(4, 1).digest
    assert kv_payload(4, 0).digest != Payload("kv", kv_payload(4, 0).tensors, {"other": 1}).digest
    with pytest.raises(ValueError, match="bad magic"):
        unpack(bytearray(128))
    with pytest.raises(ValueError, match="kind"):
        Payload("logits", {})


def test_inprocess_shares_tensors_dedups_and_frees():
    c = InProcessConnector()
    negative = kv_payload(2, 99)
    h1 = c.put("r1", {"negative": negative, "cond": kv_payload(6, 1)})
    h2 = c.put("r2", {"negative": kv_payload(2, 99), "cond": kv_payload(5, 2)})  # equal negative: stored once
    assert pickle.loads(pickle.dumps(h1)) == h1  # plain data
    got = c.get(h2, ["negative", "cond"])
    assert got["negative"] is negative  # the first copy, by reference: nothing copied
    s = c.stats()
    assert (s.puts, s.parts_put, s.dedup_hits, s.resident_payloads, s.resident_requests) == (2, 4, 1, 3, 2)
    assert s.dedup_bytes == negative.nbytes and s.bytes_copied == 0
    assert s.resident_bytes == negative.nbytes + kv_payload(6, 1).nbytes + kv_payload(5, 2).nbytes
    c.free("r1")
    c.free("r1")  # idempotent
    assert c.get(h2)["negative"] is negative  # r2 still holds the shared copy
    with pytest.raises(PayloadMissingError, match="freed"):
        c.get(h1)
    c.free("r2")
    s = c.stats()
    assert (s.resident_payloads, s.resident_bytes, s.resident_requests, s.frees, s.missing) == (0, 0, 0, 2, 1)
    with pytest.raises(ValueError, match="at least one"):
        c.put("r3", {})


def test_missing_guidance_branch_fails_clearly():
    c = make_connector("inprocess")
    handle = c.put("r", {"cond": kv_payload(3, 0)})
    with pytest.raises(PayloadMissingError, match="'negative' branch payload is missing"):
        c.get(handle, ["negative", "cond"])
    with pytest.raises(PayloadMissingError):
        PayloadHandle("x", "inprocess", ()).require(["cond"])
    with pytest.raises(ValueError, match="unknown connector"):
        make_connector("rdma")


def test_shared_memory_maps_without_copy_dedups_and_unlinks():
    producer, consumer = SharedMemoryConnector(PREFIX), SharedMemoryConnector(PREFIX)
    try:
        negative = kv_payload(2, 7)
        handles = [producer.put(f"r{i}", {"negative": kv_payload(2, 7), "cond": kv_payload(3 + i, i)})
                   for i in range(3)]
        assert len(leaked_segments(PREFIX)) == 4  # one shared negative + three conds
        s = producer.stats()
        assert s.dedup_hits == 2 and s.extra["segments"] == 4 and s.bytes_copied == s.resident_bytes
        got = consumer.get(handles[1])
        assert torch.equal(got["negative"].tensors["kv"], negative.tensors["kv"])
        assert torch.equal(got["cond"].tensors["kv"], kv_payload(4, 1).tensors["kv"])
        got["cond"].tensors["kv"].zero_()  # copy-on-write mapping: the producer's bytes never change
        fresh = SharedMemoryConnector(PREFIX)
        assert torch.equal(fresh.get(handles[1])["cond"].tensors["kv"], kv_payload(4, 1).tensors["kv"])
        fresh.free("r1")
        cs = consumer.stats()
        assert cs.bytes_copied == 0 and cs.extra["bytes_mapped"] > 0
        consumer.free("r1")
        producer.free("r0")
        producer.free("r1")
        assert len(leaked_segments(PREFIX)) == 2  # r2's cond and the negative it still holds
        with pytest.raises(PayloadMissingError, match="gone from shared memory"):
            SharedMemoryConnector(PREFIX).get(handles[0])
        producer.free("r2")
        assert leaked_segments(PREFIX) == [] and producer.stats().resident_bytes == 0
    finally:
        producer.close()
        consumer.close()


def _producer(conn) -> None:  # a separate process: the AR stage's side
    producer = SharedMemoryConnector(PREFIX)
    conn.send(producer.put("r", {"negative": kv_payload(2, 7), "cond": kv_payload(6, 3, torch.bfloat16)}))
    assert conn.recv() == "free"
    producer.free("r")
    conn.send(leaked_segments(PREFIX))


def test_shared_memory_across_processes():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_producer, args=(child,))
    process.start()
    try:
        handle = parent.recv()
        consumer = SharedMemoryConnector(PREFIX)
        got = consumer.get(handle, ["negative", "cond"])
        assert got["cond"].tensors["kv"].dtype == torch.bfloat16
        assert torch.equal(got["cond"].tensors["kv"], kv_payload(6, 3, torch.bfloat16).tensors["kv"])
        consumer.free("r")
        parent.send("free")
        assert parent.recv() == []
    finally:
        process.join(timeout=60)
    assert process.exitcode == 0 and leaked_segments(PREFIX) == []
