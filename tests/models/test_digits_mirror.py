"""The built-in `mirror` LoRA of the digits model loads by name and passes a quick judge: its
images read as the prompted digit once mirrored back; the same prompts without it, in the same
step batches, read as before. (The full judge: ``python benchmarks/quality.py --lora mirror``.)"""

from __future__ import annotations

import numpy as np
from quality import build_judge, judge_images, make_prompts

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from training.digits import data


def test_mirror_lora_passes_a_quick_judge():
    clf, _ = build_judge()
    prompts, labels = make_prompts(data.TRAIN_TEMPLATES, 2)  # 20 prompts, 2 per digit
    engine = DiffusionEngine(EngineConfig(max_batch_size=80, overlap_stages=False))
    params = [SamplingParams(seed=k % 20, num_inference_steps=10, output_type="np",
                             loras={"mirror": 1.0} if k < 20 else None) for k in range(40)]
    outs = engine.generate(prompts + prompts, params)
    images = np.stack([np.asarray(o.images)[0, :, :, 0] for o in outs])
    styled, plain = images[:20], images[20:]
    assert np.mean(judge_images(clf, styled[:, :, ::-1].copy()) == labels) >= 0.9
    asymmetric = np.isin(labels, (2, 3, 5, 6, 7))
    assert np.mean(judge_images(clf, styled)[asymmetric] == labels[asymmetric]) < 0.3
    assert np.mean(judge_images(clf, plain) == labels) >= 0.9
    assert {e["name"]: e["origin"] for e in engine.list_loras()} == {"mirror": "builtin"}
    assert max(outs[0].metrics.batch_sizes) == 80  # both arms shared every forward (40 requests x CFG)
