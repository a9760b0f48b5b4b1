"""A generative model on the real broker: continuous batching, finish reasons, deadlines, bad requests,
commits.

Parametrised over the model name so that every built-in generative model runs the same checks.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from tests.support.kafka_io import decode

pytestmark = pytest.mark.integration

MODELS: dict[str, dict[str, Any]] = {
    "synthetic-lm": {"a_ms": 2.0, "b_ms": 0.05, "fail_on": "POISON"},
}


def gen(rid: str, prompt: str, **extra: Any) -> tuple[bytes, bytes]:
    body: dict[str, Any] = {"id": rid, "inputs": {"prompt": prompt, **extra}}
    if "deadline_ms" in extra:
        body["deadline_ms"] = extra.pop("deadline_ms")
        body["inputs"] = {"prompt": prompt, **extra}
    return rid.encode(), msgspec.json.encode(body)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_generation_end_to_end(scenario, model):
    n = 240
    scenario.topics(3)
    lengths = {f"g-{i}": 1 + (i * 37) % 48 for i in range(n)}
    for part in range(3):
        scenario.produce(
            [
                gen(rid, f"event {rid}", max_new_tokens=k, seed=i)
                for i, (rid, k) in enumerate(lengths.items())
                if i % 3 == part
            ],
            partition=part,
        )
    scenario.produce([
        gen("too-many", "x", max_new_tokens=10_000),  # over model.generation.max_new_tokens
        gen("poison", "POISON here", max_new_tokens=5),  # the step raises: error result + dead letter
        gen("stopper", "s", max_new_tokens=60, stop=[" "], seed=3),
    ], partition=0)
    cfg = scenario.config(model={"name": model, "options": MODELS[model],
                                 "generation": {"max_new_tokens": 400, "max_sequences": 16,
                                                "max_batch_tokens": 2048}})
    with scenario.worker(cfg) as w:
        w.wait_assigned()
        # About 400 steps of at least 2 ms: the deadline stops it part way.
        scenario.produce([gen("late", "l", max_new_tokens=400, deadline_ms=int(time.time() * 1000) + 300)],
                         partition=1)
        results = scenario.delivered(cfg["kafka"]["group_id"], want=n + 4, timeout=120)
    by_id = {v["id"]: v for v in decode(results)}
    assert len(results) == n + 4 == len(by_id), "a duplicate or a missing result"
    for rid, k in lengths.items():
        v = by_id[rid]
        assert v["status"] == "ok", v
        out = v["outputs"]
        assert out["generated_tokens"] == len(out["token_ids"]) == k and out["finish_reason"] == "length"
        assert out["prompt_tokens"] > 0 and out["ttft_ms"] is not None and out["ttft_ms"] >= 0
        assert isinstance(out["text"], str) and v["model"] == model
    assert by_id["too-many"]["status"] == "error"
    assert "$.inputs.max_new_tokens" in by_id["too-many"]["error"]
    assert by_id["poison"]["status"] == "error" and "poison" in by_id["poison"]["error"]
    stopper = by_id["stopper"]["outputs"]
    assert stopper["finish_reason"] == "stop" and " " not in stopper["text"]
    late = by_id["late"]
    assert late["status"] == "expired", late
    if late.get("outputs") is not None:  # (a loaded machine may have read it past its deadline: no tokens)
        assert (
            late["outputs"]["finish_reason"] == "deadline" and 0 < late["outputs"]["generated_tokens"] < 400
        )
    dlq = scenario.read_dlq(want=3, timeout=30)
    stages = sorted(dict(m.headers())["x-error-stage"].decode() for m in dlq)
    assert stages == ["decode", "expired", "inference"], stages

    # Committed at the end: a restart processes nothing again.
    with scenario.worker(cfg, name="restart") as w2:
        w2.wait_assigned()
        scenario.produce([gen("after", "again", max_new_tokens=3)], partition=1)
        scenario.read_out(want=n + 5, timeout=60)
    again = decode(scenario.read_out(timeout=30, idle=2))
    assert len(again) == n + 5, f"restart reprocessed {len(again) - n - 5} records"


def _greedy_reference(prompts: dict[str, tuple[str, int]]) -> dict[str, list[int]]:
    """``generate(do_sample=False)`` on each prompt alone, cut before the first EOS: a result's token ids
    are the generated ones, without the EOS that ended them."""
    import torch

    from worker.models.tiny_lm import TinyLM

    h = TinyLM()
    h.setup("cpu")
    m = h.step_model()
    want: dict[str, list[int]] = {}
    for rid, (prompt, k) in prompts.items():
        ids = torch.tensor([m.encode(prompt)])
        out = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,  # type: ignore[attr-defined]
                               do_sample=False)
        toks = out[0, ids.shape[1]:].tolist()
        eos = m.eos_token_id
        want[rid] = toks[: toks.index(eos)] if eos in toks else toks
    return want


def test_tiny_lm_through_the_worker_gives_what_generate_gives_alone(scenario):
    """The random-weight tiny-lm, continuously batched across 2 partitions: every greedy result holds the
    tokens ``generate`` gives for its prompt alone, whatever ran beside it, and the offsets reach the end."""
    scenario.topics(2)
    prompts = {f"t-{i}": (f"event {i} " * (1 + i % 4), 4 + (i * 7) % 29) for i in range(24)}
    for part in range(2):
        scenario.produce([gen(rid, p, max_new_tokens=k) for i, (rid, (p, k)) in enumerate(prompts.items())
                          if i % 2 == part], partition=part)
    cfg = scenario.config(model={"name": "tiny-lm",
                                 "generation": {"max_new_tokens": 64, "max_sequences": 8,
                                                "max_batch_tokens": 1024}})
    results, _ = scenario.serve(cfg, want=len(prompts), timeout=180, assigned_first=True)
    by_id = {v["id"]: v for v in decode(results)}
    assert sorted(by_id) == sorted(prompts), "a duplicate or a missing result"
    want = _greedy_reference(prompts)
    for rid, v in by_id.items():
        assert v["status"] == "ok" and v["model"] == "tiny-lm", v
        out = v["outputs"]
        assert out["token_ids"] == want[rid], rid
        assert out["generated_tokens"] == len(want[rid])
        assert out["finish_reason"] == ("length" if len(want[rid]) == prompts[rid][1] else "eos"), (rid, out)
