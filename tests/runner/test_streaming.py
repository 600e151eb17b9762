"""Streaming video chunks and mid-stream interactions on the tiny Wan folders: the chunk event
contract, conditioning of each chunk on the previous one, interactions (prompt blending, event
ids, refusals), abort mid-stream, batching with other requests, the multi-process executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, EventType, InvalidRequestError, SamplingParams
from diffserve.core.errors import InteractionRefusedError
from diffserve.core.outputs import RequestStatus
from diffserve.pipelines.video_chunks import ChunkCondition, frames_to_video_tensor

SIZE = dict(height=32, width=48, num_frames=9)  # 3 latent frames of 4x6 per chunk


def _p(seed=0, chunks=3, steps=2, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=5.0, num_chunks=chunks,
                          output_type=kw.pop("output_type", "np"), **{**SIZE, **kw})


@pytest.fixture(scope="module")
def wan(tiny_wan_dir):
    """Inline encode/decode/chunk work (``overlap_stages=False``): exact interleavings."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_wan_dir), max_batch_size=16, overlap_stages=False))
    yield engine
    assert not engine.has_unfinished_requests()
    assert not engine.runner.states and not engine.runner.streams


def _run(engine, on_event=None):
    """Step until idle; every event by request id, in order."""
    events: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
            if on_event is not None:
                on_event(event)
    return events


def _chunks(events):
    return [e for e in events if e.type is EventType.CHUNK]


def test_chunk_events_and_final_video(wan):
    rid = wan.add_request("a cat surfing", _p())
    events = _run(wan)[rid]
    kinds = [e.type for e in events]
    assert kinds[:2] == [EventType.QUEUED, EventType.STARTED] and kinds[-1] is EventType.FINISHED
    chunks = _chunks(events)
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    assert kinds.index(EventType.CHUNK) < kinds.index(EventType.PROGRESS, kinds.index(EventType.CHUNK))
    # the first chunk is a whole clip; later ones leave out the frame they repeat
    assert [c.output.shape for c in chunks] == [(9, 32, 48, 3), (8, 32, 48, 3), (8, 32, 48, 3)]
    assert all(c.output.dtype == np.uint8 for c in chunks)
    progress = [(e.chunk_index, e.step, e.total) for e in events if e.type is EventType.PROGRESS]
    assert progress == [(k, s, 2) for k in range(3) for s in (1, 2)]
    out = events[-1].output
    assert out.ok and len(out.videos) == 1
    np.testing.assert_array_equal(out.videos[0], np.concatenate([c.output for c in chunks]))
    m = out.metrics
    assert m.num_steps == 6 and len(m.chunk_s) == 3 and m.chunk_s == sorted(m.chunk_s)
    assert m.first_chunk_s == m.chunk_s[0] > 0 and "chunk_s" in m.as_dict()


def test_first_chunk_is_the_ordinary_generation(wan):
    [plain] = wan.generate("a cat surfing", _p(chunks=None))
    [stream] = wan.generate("a cat surfing", _p(chunks=2))
    np.testing.assert_array_equal(stream.videos[0][:9], plain.videos[0])
    assert stream.videos[0].shape == (17, 32, 48, 3)


def test_output_types_of_the_whole_video(wan):
    [pil] = wan.generate("a cat", _p(chunks=2, output_type="pil"))
    [pt] = wan.generate("a cat", _p(chunks=2, output_type="pt"))
    assert len(pil.videos[0]) == 17 and pil.videos[0][0].size == (48, 32)
    assert pt.videos[0].dtype == torch.uint8 and tuple(pt.videos[0].shape) == (17, 32, 48, 3)
    np.testing.assert_array_equal(np.stack([np.asarray(f) for f in pil.videos[0]]), pt.videos[0].numpy())


def test_next_chunk_is_conditioned_on_the_last_frame(wan):
    """White box, on the runner: after a chunk boundary the new chunk's first latent frame is the
    VAE encoding of the previous chunk's last frame at the first step's noise level, and after
    the chunk's last step exactly that encoding (the replacement method)."""
    seen = {}

    def on_event(event):  # a listener: called on the stepping thread as each event happens
        state = wan.runner.states.get(event.request_id)
        if event.type is EventType.CHUNK and event.chunk_index == 0:
            seen["frames"] = event.output
            seen["condition"] = state.chunk_condition
            seen["start"] = state.latents.clone()
        if event.type is EventType.PROGRESS and event.chunk_index == 1 and event.step == 3:
            seen["end"] = state.latents.clone()

    wan.add_request("a cat surfing", _p(chunks=2, steps=3), listener=on_event)
    _run(wan)
    cond: ChunkCondition = seen["condition"]
    adapter = wan.runner.adapter
    vae = adapter.pipe.vae
    with torch.no_grad():
        z = vae.encode(frames_to_video_tensor(seen["frames"][-1:], adapter.device, vae.dtype)).latent_dist.mode()
    mean, inv_std = adapter._latent_stats(torch.float32, z.device)
    torch.testing.assert_close(cond.clean, (z - mean) * inv_std)
    sigma0 = float(cond.sigmas[0])
    assert 0.9 < sigma0 <= 1.0 and float(cond.sigmas[-1]) == 0.0
    torch.testing.assert_close(seen["start"][:, :, :1], (1 - sigma0) * cond.clean + sigma0 * cond.noise)
    torch.testing.assert_close(seen["end"][:, :, :1], cond.clean)
    assert not torch.equal(seen["end"][:, :, 1:], seen["start"][:, :, 1:])  # the rest was denoised


def test_expand_timesteps_model_gets_a_clean_first_frame_with_timestep_0_tokens(tiny_wan_dir, tmp_path):
    """A folder with ``expand_timesteps`` (per-token timesteps, Wan 2.2 TI2V): a stream chunk's
    latent frame 0 is the clean encoding of the previous chunk's last frame at EVERY step, and the
    transformer gets timestep 0 for its tokens and the step's timestep for the others, while a
    plain request batched with it gets the step's timestep everywhere."""
    import json
    import shutil

    folder = tmp_path / "wan_ti2v"
    shutil.copytree(tiny_wan_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    engine = DiffusionEngine(EngineConfig(model=str(folder), max_batch_size=16, overlap_stages=False))
    adapter = engine.runner.adapter
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (timestep, hidden_states) per forward
    transformer = adapter.experts[0]
    hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["timestep"].clone(), kwargs["hidden_states"].clone())),
        with_kwargs=True)
    latent_frames: dict[int, torch.Tensor] = {}

    def on_event(event):
        state = engine.runner.states.get(event.request_id)
        if event.type is EventType.PROGRESS and event.chunk_index == 1 and state is not None:
            latent_frames[event.step] = state.latents[:, :, :1].clone()

    try:
        stream = engine.add_request("a cat surfing", _p(chunks=2, steps=3), listener=on_event)
        _run(engine)
        added = []

        def add_plain(event):  # a plain request arrives when the second stream's chunk 0 is out
            if event.type is EventType.CHUNK and event.chunk_index == 0:
                added.append(engine.add_request("a dog", SamplingParams(
                    seed=2, num_inference_steps=3, guidance_scale=5.0, output_type="np", **SIZE)))

        stream2 = engine.add_request("a cat surfing", _p(seed=1, chunks=2, steps=3), listener=add_plain)
        events = _run(engine)
    finally:
        hook.remove()
    assert events[added[0]][-1].output.ok and stream and stream2 and not engine.runner.states
    # chunk 1 of the first stream: frame 0 stays the same clean latent at every step
    frames = list(latent_frames.values())
    assert len(frames) == 3 and all(torch.equal(f, frames[0]) for f in frames)
    tokens_per_frame = (32 // 8 // 2) * (48 // 8 // 2)  # latent 4x6, patch 2x2
    # forwards of the first stream alone: chunk 0 (3 steps) plain, chunk 1 (3 steps) conditioned
    for timestep, _ in seen[:3]:
        assert timestep.shape == (2, 3 * tokens_per_frame) and (timestep == timestep[:, :1]).all()
    for timestep, _ in seen[3:6]:
        assert (timestep[:, :tokens_per_frame] == 0).all() and (timestep[:, tokens_per_frame:] > 0).all()
    # the plain request batched with the second stream's conditioned chunk: rows differ
    mixed = [t for t, h in seen[6:] if t.shape[0] == 4 and (t[:, :tokens_per_frame] == 0).any()]
    assert mixed, [t.shape for t, _ in seen[6:]]
    for timestep in mixed:  # branch-major rows: (uncond plain, uncond stream, cond plain, cond stream)
        zero_rows = (timestep[:, :tokens_per_frame] == 0).all(1)
        assert zero_rows.sum() == 2 and (timestep[~zero_rows] == timestep[~zero_rows][:, :1]).all()
        assert (timestep[zero_rows][:, tokens_per_frame:] > 0).all()


def test_chunk_condition_apply_is_not_in_place():
    cond = ChunkCondition(clean=torch.ones(1, 2, 1, 2, 2), noise=torch.zeros(1, 2, 1, 2, 2),
                          sigmas=torch.tensor([1.0, 0.25, 0.0]))
    latents = torch.full((1, 2, 3, 2, 2), 5.0)
    out = cond.apply(latents, 1)
    assert torch.equal(latents, torch.full_like(latents, 5.0))
    assert torch.allclose(out[:, :, 0], torch.full((1, 2, 2, 2), 0.75)) and torch.equal(out[:, :, 1:], latents[:, :, 1:])
    assert torch.equal(cond.apply(latents, 5)[:, :, 0], torch.ones(1, 2, 2, 2))  # past the end: clean


def test_blend_of_folded_prompts_of_different_lengths_is_the_folded_blend():
    """With Wan context folding the two prompts' inputs have different lengths; their blend
    equals the blend of the full, zero-padded forms, folded."""
    from diffserve.pipelines.wan.context_folding import fold_padding_rows
    from diffserve.runner.streaming import blend_inputs

    torch.manual_seed(0)
    full = torch.zeros(2, 1, 16, 4)
    full[0, :, :3], full[1, :, :7] = torch.randn(1, 3, 4), torch.randn(1, 7, 4)
    short, long = fold_padding_rows(full[0]), fold_padding_rows(full[1])
    assert short.shape[1] == 4 and long.shape[1] == 8
    for a, b in ((short, long), (long, short)):
        blended = blend_inputs({"encoder_hidden_states": a}, {"encoder_hidden_states": b}, 0.25)
        want = torch.lerp(full[0 if a is short else 1], full[1 if a is short else 0], 0.25)
        torch.testing.assert_close(blended["encoder_hidden_states"], fold_padding_rows(want))
    with pytest.raises(ValueError, match="cannot blend"):
        blend_inputs(torch.zeros(1, 3, 4), torch.zeros(1, 3, 5), 0.5)


def test_interaction_blends_the_prompt_and_returns_its_event_id(wan):
    """An interaction sent while chunk 1 denoises applies from chunk 2: with 1 transition chunk,
    chunk 2's conditional prompt inputs are the halfway blend and chunk 3's the new prompt's;
    chunks before it equal the stream without interaction, and the event id comes back on
    chunk 2 only."""
    encode = wan.runner.adapter.text.encode
    cat, dog = encode("a cat surfing", 512)[0], encode("a dog running", 512)[0]
    [baseline] = wan.generate("a cat surfing", _p(chunks=4))
    rid = wan.add_request("a cat surfing", _p(chunks=4))
    used = {}

    def on_event(event):
        if event.type is EventType.CHUNK:
            state = wan.runner.states.get(rid)
            if state is not None:  # set up for the next chunk already (inline chunk work)
                used[event.chunk_index + 1] = state.branches[-1]["encoder_hidden_states"].clone()
            if event.chunk_index == 0:
                assert wan.submit_interaction(rid, {"prompt": "a dog running", "transition_chunks": 1,
                                                    "event_id": "dog-1"}) == "dog-1"

    events = _run(wan, on_event)[rid]
    chunks = _chunks(events)
    assert [c.event_ids for c in chunks] == [[], [], ["dog-1"], []]
    torch.testing.assert_close(used[1], cat)
    torch.testing.assert_close(used[2], torch.lerp(cat, dog, 0.5))
    torch.testing.assert_close(used[3], dog)
    video = events[-1].output.videos[0]
    np.testing.assert_array_equal(video[:17], baseline.videos[0][:17])  # chunks 0 and 1 unchanged
    assert not np.array_equal(video[17:], baseline.videos[0][17:])


def test_interaction_without_transition_and_generated_event_id(wan):
    rid = wan.add_request("a cat surfing", _p(chunks=3))
    ids = []

    def on_event(event):
        if event.type is EventType.CHUNK and event.chunk_index == 0:
            ids.append(wan.submit_interaction(rid, {"prompt": "first"}))
            ids.append(wan.submit_interaction(rid, {"prompt": "a dog running", "event_id": "second"}))
            state = wan.runner.states[rid]
            ids.append(state.branches[-1]["encoder_hidden_states"].clone())

    chunks = _chunks(_run(wan, on_event)[rid])
    generated, given, _ = ids
    assert len(generated) == 32 and given == "second"
    assert chunks[2].event_ids == [generated, "second"]  # both first used by chunk 2; the last prompt wins


def test_interaction_refusals(wan, engine):
    with pytest.raises(InteractionRefusedError) as info:
        wan.submit_interaction("nope", {"prompt": "a dog"})
    assert info.value.reason == "unknown_request" and info.value.field == "request_id"

    ordinary = wan.add_request("a cat", _p(chunks=None))
    with pytest.raises(InteractionRefusedError) as info:
        wan.submit_interaction(ordinary, {"prompt": "a dog"})
    assert info.value.reason == "not_streaming" and "num_chunks" in str(info.value)
    two = wan.add_request("a cat", _p(chunks=2))
    wan.step()  # both admitted and stepping chunk 0 of `two`: chunk 1 is its last
    refusals = []

    def on_event(event):
        if event.type is EventType.CHUNK and event.chunk_index == 0:
            with pytest.raises(InteractionRefusedError) as late:
                wan.submit_interaction(two, {"prompt": "a dog"})
            refusals.append(late.value.reason)

    _run(wan, on_event)
    assert refusals == ["last_chunk"]
    with pytest.raises(InteractionRefusedError) as info:
        wan.submit_interaction(two, {"prompt": "a dog"})
    assert info.value.reason == "finished" and "ended" in str(info.value)

    stream = wan.add_request("a cat", _p(chunks=3))
    for bad, field in (({"prompt": ""}, "prompt"), ({}, "prompt"), ({"prompt": "x", "transition_chunks": -1},
                       "transition_chunks"), ({"prompt": "x", "transition_chunks": True}, "transition_chunks"),
                       ({"prompt": "x", "event_id": 7}, "event_id"), ({"prompt": "x", "event_id": "a\nb"}, "event_id"),
                       ({"prompt": "x", "colour": "red"}, "colour")):
        with pytest.raises(InvalidRequestError) as info:
            wan.submit_interaction(stream, bad)
        assert info.value.field == field and not isinstance(info.value, InteractionRefusedError)
    wan.abort(stream)
    with pytest.raises(InteractionRefusedError) as info:
        wan.submit_interaction(stream, {"prompt": "a dog"})
    assert info.value.reason == "finished"
    _run(wan)

    # an image model: num_chunks is refused, and its requests take no interactions
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("a cat", SamplingParams(num_chunks=2))
    assert info.value.field == "num_chunks"
    image = engine.add_request("a cat", SamplingParams(seed=0, num_inference_steps=1))
    with pytest.raises(InteractionRefusedError) as info:
        engine.submit_interaction(image, {"prompt": "a dog"})
    assert info.value.reason == "unsupported"
    _run(engine)


@pytest.mark.parametrize("params, field", [
    (dict(num_chunks=0), "num_chunks"),
    (dict(num_chunks=1025), "num_chunks"),
    (dict(num_chunks=2, num_images_per_prompt=2), "num_images_per_prompt"),
    (dict(num_chunks=2, output_type="latent"), "output_type"),
    (dict(num_chunks=2, num_frames=1), "num_frames"),  # no new frame after the repeated one
])
def test_stream_params_validation(wan, params, field):
    with pytest.raises(InvalidRequestError) as info:
        wan.add_request("a cat", SamplingParams(**{**SIZE, **params}))
    assert info.value.field == field
    if field == "num_frames":
        assert ">= 5 with num_chunks > 1" in str(info.value)
        [one] = wan.generate("a cat", SamplingParams(**{**SIZE, "num_frames": 1, "num_chunks": 1, "seed": 0,
                                                        "num_inference_steps": 1, "output_type": "np"}))
        assert one.ok and one.videos[0].shape[0] == 1  # one chunk of one frame is fine


def test_abort_mid_stream_stops_at_the_next_step(wan):
    rid = wan.add_request("a cat surfing", _p(chunks=4))
    other = wan.add_request("a bird", _p(chunks=None, steps=8))

    def on_event(event):
        if event.request_id == rid and event.type is EventType.CHUNK and event.chunk_index == 1:
            assert wan.abort(rid)

    events = _run(wan, on_event)
    mine = events[rid]
    assert mine[-1].type is EventType.ABORTED and mine[-1].output.status is RequestStatus.ABORTED
    assert [c.chunk_index for c in _chunks(mine)] == [0, 1]
    assert not [e for e in mine if e.type is EventType.PROGRESS and e.chunk_index == 2]
    assert mine[-1].output.metrics.num_steps == 4
    assert events[other][-1].output.ok  # the other request is unaffected
    assert rid not in wan.runner.states and rid not in wan.runner.streams


def test_stream_batches_with_other_requests(wan):
    """A stream shares forwards with ordinary requests of the same batch key (before and
    between its chunk boundaries), and its video equals its solo run. Each chunk boundary
    goes out with the tick after the chunk's last step, beside that tick's step, which the other
    request takes alone (inline here; on the side thread it would overlap several steps)."""
    [solo] = wan.generate("a cat surfing", _p(chunks=3))
    [solo_other] = wan.generate("a bird", _p(seed=5, chunks=None, steps=6))
    rid = wan.add_request("a cat surfing", _p(chunks=3))
    other = wan.add_request("a bird", _p(seed=5, chunks=None, steps=6))
    events = _run(wan)
    stream_out, other_out = events[rid][-1].output, events[other][-1].output
    assert stream_out.metrics.batch_sizes == {4: 4, 2: 2}  # 2 x CFG rows; the last chunk after `other` ended
    assert other_out.metrics.batch_sizes == {4: 4, 2: 2}  # alone while the stream's chunk boundaries ran
    diff = np.abs(stream_out.videos[0].astype(int) - solo.videos[0].astype(int))
    assert diff.max() <= 1, diff.max()  # batched forwards differ by float rounding only
    assert np.abs(other_out.videos[0].astype(int) - solo_other.videos[0].astype(int)).max() <= 1


def test_streams_overlap_with_side_thread(tiny_wan_dir):
    """With the encode/decode side thread, two streams and an ordinary request all finish, the
    chunk boundaries run beside the steps, and the videos equal the inline engine's."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_wan_dir), max_batch_size=16))
    try:
        outs = engine.generate(["a cat", "a dog", "a bird"], [_p(1, chunks=3), _p(2, chunks=2), _p(3, chunks=None)])
    finally:
        engine.shutdown()
    assert [o.videos[0].shape[0] for o in outs] == [25, 17, 9] and all(o.ok for o in outs)
    assert len(outs[0].metrics.chunk_s) == 3 and len(outs[2].metrics.chunk_s) == 0


def test_multiprocess_executor_forwards_chunks_and_interactions(tiny_wan_dir, wan):
    """The chunk work and its interactions cross the process boundary as plain data: the worker
    process produces the same stream as the in-process runner."""
    def stream(engine):
        rid = engine.add_request("a cat surfing", _p(chunks=3))
        sent = []

        def on_event(event):
            if event.type is EventType.CHUNK and event.chunk_index == 0:
                sent.append(engine.submit_interaction(rid, {"prompt": "a dog running", "event_id": "e"}))

        return _run(engine, on_event)[rid]

    local = stream(wan)
    engine = DiffusionEngine(EngineConfig(model=str(tiny_wan_dir), executor="multiprocess", num_threads=1,
                                          overlap_stages=False))
    try:
        remote = stream(engine)
    finally:
        engine.shutdown()
    assert [c.event_ids for c in _chunks(remote)] == [[], [], ["e"]]
    np.testing.assert_array_equal(remote[-1].output.videos[0], local[-1].output.videos[0])


def test_cfg_parallel_stream_with_clean_first_frame_equals_one_process(tiny_wan_dir, tmp_path):
    """CFG parallelism splits a step's rows across 2 ranks: a stream chunk's timestep-0 tokens
    (``expand_timesteps`` folders) travel with their rows, so 2 ranks give the single-process
    stream (a plain request batched with it included)."""
    import json
    import shutil

    folder = tmp_path / "wan_ti2v"
    shutil.copytree(tiny_wan_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    plain = SamplingParams(seed=2, num_inference_steps=2, guidance_scale=5.0, output_type="latent", **SIZE)

    def run(engine):
        outs = engine.generate(["a cat surfing", "a dog"], [_p(chunks=3, output_type="np"), plain])
        assert all(o.ok for o in outs), [o.error for o in outs]
        return outs

    local = run(DiffusionEngine(EngineConfig(model=str(folder), num_threads=1)))
    engine = DiffusionEngine(EngineConfig(model=str(folder), num_threads=1, cfg_parallel_size=2))
    try:
        remote = run(engine)
    finally:
        engine.shutdown()
    assert np.abs(remote[0].videos[0].astype(int) - local[0].videos[0].astype(int)).max() <= 1
    torch.testing.assert_close(remote[1].videos[0], local[1].videos[0], atol=1e-5, rtol=0)
