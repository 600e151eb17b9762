"""Step-level batching: continuous admission, mixed step counts, order (batch invariance of every
family: tests/conformance/test_batching.py)."""

from __future__ import annotations

import numpy as np

from diffserve import EventType, SamplingParams

TOL = 1e-4


def _p(seed, steps=4, guidance=4.0, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=guidance, output_type="np", **kw)


def _solo(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out.images


def test_request_added_mid_run_joins_next_step(sync_engine):
    """A request added while another runs is admitted at the next tick, prepared beside that
    tick's step (inline here: the scheduler output carries its prepare and the running batch's
    step together) and joins the step after: one forward, two requests at different steps.
    (`sync_engine` has the join wait off; with it, see `test_join_wait_*` below.)"""
    engine = sync_engine
    first = engine.add_request("a red car", _p(1, steps=6))
    engine.step()  # admits + prepares, then runs step 1 of `first` (a second tick of the same call)
    engine.step()
    late = engine.add_request("a blue car", _p(2, steps=3))
    events = engine.step()
    started = [e for e in events if e.type is EventType.STARTED]
    progress = {e.request_id: e.step for e in events if e.type is EventType.PROGRESS}
    assert [e.request_id for e in started] == [late]
    assert progress == {first: 3}  # `late` was prepared in this tick, beside the step
    progress = {e.request_id: e.step for e in engine.step() if e.type is EventType.PROGRESS}
    assert progress == {first: 4, late: 1}  # one forward, two requests at different steps
    finals = {}
    while engine.has_unfinished_requests():
        for e in engine.step():
            if e.type.is_final:
                finals[e.request_id] = e.output
    assert finals[late].metrics.batch_sizes == {4: 3}
    assert np.abs(finals[late].images - _solo(engine, "a blue car", _p(2, steps=3))).max() <= TOL
    assert np.abs(finals[first].images - _solo(engine, "a red car", _p(1, steps=6))).max() <= TOL


def test_join_wait_lets_a_late_request_join_the_next_forward(engine):
    """With the join wait (its bound made generous here: the real one compares measured prepare
    and step seconds), the tick that admits a request of the stepping batch's key holds its step
    for the background prepare, so the request's first step shares the very next forward;
    without it the running request steps alone at least once more. Outputs equal solo runs."""
    def alone_steps_after_arrival() -> int:
        first = engine.add_request("a red car", _p(1, steps=12))
        done = 0
        while done < 2:
            done += sum(e.type is EventType.PROGRESS for e in engine.step())
        late = engine.add_request("a blue car", _p(2, steps=3))
        alone = 0
        while True:
            stepped = {e.request_id for e in engine.step() if e.type is EventType.PROGRESS}
            if late in stepped:
                break
            alone += first in stepped
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({e.request_id: e.output for e in engine.step() if e.type.is_final})
        assert finals[late].metrics.batch_sizes == {4: 3}
        assert np.abs(finals[late].images - _solo(engine, "a blue car", _p(2, steps=3))).max() <= TOL
        return alone

    waits, fraction = engine.stats()["scheduler"]["join_waits"], engine.scheduler.join_wait_fraction
    try:
        engine.scheduler.join_wait_fraction = 100.0
        assert alone_steps_after_arrival() == 0
        assert engine.stats()["scheduler"]["join_waits"] == waits + 1
        engine.scheduler.join_wait_fraction = 0.0
        assert alone_steps_after_arrival() >= 1
    finally:
        engine.scheduler.join_wait_fraction = fraction


def test_steps_of_an_unchanged_batch_are_booked_exactly(sync_engine):
    """The engine books the steps of an unchanged batch once for all its requests (`StepRun`):
    metrics, previews and progress events still come out step-exact when a request joins,
    leaves, previews, asks for no progress events, or is aborted mid-run."""
    engine = sync_engine
    a = engine.add_request("a red car", _p(1, steps=7), preview_steps=[4])
    events = engine.step() + engine.step()  # `a` alone: steps 1-2
    b = engine.add_request("a blue car", _p(2, steps=3), progress=False)  # shares a's steps 3-5
    c = engine.add_request("a green car", _p(3, steps=9, guidance=1.0))  # no CFG: its own batch key
    finals = {}
    while engine.has_unfinished_requests():
        step_events = engine.step()
        events += step_events
        if any(e.request_id == c and e.type is EventType.PROGRESS and e.step == 2 for e in step_events):
            engine.abort(c)
        finals.update({e.request_id: e.output for e in step_events if e.type.is_final})
    progress = [(e.request_id, e.step, e.total) for e in events if e.type is EventType.PROGRESS]
    assert [(s, t) for r, s, t in progress if r == a] == [(s, 7) for s in range(1, 8)]
    assert not any(r == b for r, _, _ in progress)  # it asked for none
    assert [e.step for e in events if e.type is EventType.PARTIAL and e.request_id == a] == [4]
    assert (finals[a].metrics.num_steps, finals[a].metrics.batch_sizes) == (7, {2: 4, 4: 3})
    assert (finals[b].metrics.num_steps, finals[b].metrics.batch_sizes) == (3, {4: 3})
    assert finals[c].status == "aborted" and finals[c].metrics.num_steps == 2
    assert finals[b].metrics.denoise_s < finals[a].metrics.denoise_s
    assert np.abs(finals[b].images - _solo(engine, "a blue car", _p(2, steps=3))).max() <= TOL
    assert np.abs(finals[a].images - _solo(engine, "a red car", _p(1, steps=7))).max() <= TOL


def test_a_preview_shows_its_own_step_while_the_batch_steps_on_in_place(engine, sync_engine, monkeypatch):
    """An unchanged batch steps its latents in place; a preview decoded on the side thread while
    the steps go on (here: a slow VAE) still shows the latents of its own step."""
    import time

    adapter = engine.runner.adapter
    decode_many = adapter.decode_many

    def slow_decode(states, latents):
        time.sleep(0.05)  # several steps run meanwhile
        return decode_many(states, latents)

    monkeypatch.setattr(adapter, "decode_many", slow_decode)

    def previews(eng, jobs):
        ids = [eng.add_request(prompt, params, preview_steps=[3]) for prompt, params in jobs]
        got = {}
        while eng.has_unfinished_requests():
            got.update({e.request_id: e.preview for e in eng.step() if e.type is EventType.PARTIAL})
        return [got[i] for i in ids]

    jobs = [("a red car", _p(1, steps=12)), ("a blue car", _p(2, steps=12))]
    batched = previews(engine, jobs)
    for job, preview in zip(jobs, batched):
        [alone] = previews(sync_engine, [job])  # decoded inline, before any further step
        assert np.abs(np.asarray(preview) - np.asarray(alone)).max() <= TOL


def test_arrival_order_does_not_change_outputs(engine):
    prompts = ["one", "two", "three"]
    params = [_p(21, steps=2), _p(22, steps=3), _p(23, steps=4, guidance=1.0)]
    forward = engine.generate(prompts, params)
    backward = engine.generate(prompts[::-1], params[::-1])[::-1]
    for a, b in zip(forward, backward):
        assert np.abs(a.images - b.images).max() <= TOL


def test_mixed_cfg_is_not_batched_together_but_mixed_sizes_are(engine):
    """CFG on and off never share a forward (different branch counts); SD3 requests of
    different sizes do (`PipelineAdapter.mixed_sizes`, each row its own span)."""
    outs = engine.generate(["a", "b", "c"], [_p(1), _p(2, guidance=1.0), _p(3, height=32, width=48)])
    assert [max(o.metrics.batch_sizes) for o in outs] == [4, 1, 4]
    assert outs[2].images.shape == (1, 32, 48, 3)
    assert np.abs(outs[2].images - _solo(engine, "c", _p(3, height=32, width=48))).max() <= TOL


def test_late_request_joins_a_running_batch_with_overlapped_encode(engine):
    """With encode/decode beside the steps (the default), a request added while another runs
    is prepared in the background and then shares its forwards; outputs equal solo runs."""
    first = engine.add_request("a red car", _p(1, steps=30))
    engine.step()
    late = engine.add_request("a blue car", _p(2, steps=3))
    finals = {}
    while engine.has_unfinished_requests():
        for e in engine.step():
            if e.type.is_final:
                finals[e.request_id] = e.output
    assert finals[late].metrics.batch_sizes == {4: 3}  # all its steps shared a forward
    assert np.abs(finals[late].images - _solo(engine, "a blue car", _p(2, steps=3))).max() <= TOL
    assert np.abs(finals[first].images - _solo(engine, "a red car", _p(1, steps=30))).max() <= TOL


def test_cached_batch_reads_each_rows_own_timestep_and_sigma_step(engine):
    """A batch of requests at different points of different schedules, stepped repeatedly
    through the adapter (so its `BatchCache` tables are used): every step each row's timestep
    and Euler step are the ones of its own request, as stepping it alone computes them."""
    import torch

    from diffserve.pipelines.base import RequestState

    runner = engine.executor.runner
    adapter = runner.adapter
    states = []
    for i, (steps, ahead, images) in enumerate(((6, 0, 1), (9, 3, 2), (4, 1, 1))):
        params = _p(i, steps=steps, num_images_per_prompt=images).resolve(adapter.spec, runner.config.limits)
        state = RequestState(f"r{i}", "a cat", params)
        with torch.inference_mode():
            adapter.prepare(state)
            for _ in range(ahead):  # move it along its schedule alone first
                batch = adapter.collate([state])
                adapter.step(batch, adapter.combine(batch, adapter.denoise(batch)))
        states.append(state)
    for _ in range(3):  # the shortest has 3 steps left
        want_t = torch.cat([s.timestep.expand(s.num_images) for s in states]).float()
        want_dt = torch.cat([(s.sigmas[s.step_index + 1] - s.sigmas[s.step_index]).expand(s.num_images)
                             for s in states])
        before = [s.latents.clone() for s in states]  # an unchanged batch steps its latents in place
        with torch.inference_mode():
            batch = adapter.collate(states)
            assert torch.equal(batch.timesteps.float(), want_t)
            assert torch.equal(batch.inputs["timestep"].float(), want_t.repeat(2))  # both CFG branches
            guided = adapter.combine(batch, adapter.denoise(batch))
            assert adapter.step(batch, guided) == {}
        for state, x0, g, dt in zip(states, before, batch.split(guided), batch.split(want_dt)):
            assert torch.allclose(state.latents, x0 + dt.view(-1, 1, 1, 1) * g, atol=1e-6)
    assert batch.cache is not None and batch.cache.ahead == 3  # one set of tables served all 3 steps
    for state in states:
        state.release()


def test_step_tables_gather_each_requests_schedule_from_its_step_on():
    """`_step_tables` (one gather for all requests) against a plain per-request reading:
    requests of different schedule lengths and positions, some with several latent rows; rows
    past a request's end repeat its last value; sigma steps are differences of neighbours."""
    import random

    import torch

    from diffserve.pipelines.step_batch import _step_tables

    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        steps = [rng.randrange(n) for n in lengths]
        images = [rng.choice([1, 1, 2, 3]) for _ in lengths]
        timesteps = [torch.rand(n) * 1000 for n in lengths]
        sigmas = [torch.sort(torch.rand(n + 1), descending=True).values for n in lengths]
        horizon = max(n - i for n, i in zip(lengths, steps))
        repeats = torch.tensor(images) if any(k != 1 for k in images) else None
        t, dt = _step_tables(timesteps, sigmas, steps, horizon, torch.device("cpu"), repeats)
        assert t.shape == dt.shape == (horizon, sum(images)) and t.dtype == dt.dtype == torch.float32
        assert torch.equal(_step_tables(timesteps, None, steps, horizon, torch.device("cpu"), repeats)[0], t)
        for k in range(horizon):
            col = 0
            for ts, sig, i, n, rows in zip(timesteps, sigmas, steps, lengths, images):
                j = min(i + k, n - 1)
                assert torch.equal(t[k, col:col + rows], ts[j].expand(rows))
                assert torch.equal(dt[k, col:col + rows], (sig[j + 1] - sig[j]).expand(rows))
                col += rows


def test_per_request_diffusion_schedulers_are_independent_copies():
    """`new_scheduler` shares only the immutable config: a copy's timesteps and multistep
    history never reach the template or another copy."""
    import torch
    from diffusers import DPMSolverMultistepScheduler

    from diffserve.pipelines.diffusion_scheduler import new_scheduler

    template = DPMSolverMultistepScheduler()
    a, b = new_scheduler(template), new_scheduler(template)
    assert a.config is template.config and type(a) is type(template)
    a.set_timesteps(10)
    b.set_timesteps(4)
    assert len(a.timesteps) == 10 and len(b.timesteps) == 4 and len(template.timesteps) == 1000
    x = torch.zeros(1, 4, 8, 8)
    a.step(torch.ones_like(x), a.timesteps[0], x)
    assert a.model_outputs[-1] is not None and all(o is None for o in b.model_outputs)
    assert all(o is None for o in template.model_outputs)
    # tensor attributes are copies too (cloned, not shared): an in-place write stays in its copy
    c = new_scheduler(template)
    assert torch.equal(c.betas, template.betas) and torch.equal(c.alphas_cumprod, template.alphas_cumprod)
    c.betas.mul_(0)
    c.alphas_cumprod.add_(1)
    assert template.betas.max() > 0 and a.betas.max() > 0 and template.alphas_cumprod.max() <= 1
