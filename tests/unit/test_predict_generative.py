"""``worker predict`` and ``worker profile`` with a generative handler (synthetic-lm)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import msgspec
import pytest

from schemas import Result
from worker.app.cli import main

CONFIG = """\
kafka: {input_topics: [requests]}
model:
  name: synthetic-lm
  options: {a_ms: 0.5, b_ms: 0.0}
  generation: {max_new_tokens: 20, max_sequences: 2}
"""


def test_predict_generates_each_request_and_names_a_bad_field(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "worker.yaml"
    cfg.write_text(textwrap.dedent(CONFIG))
    lines = [{"id": f"r{i}", "inputs": {"prompt": f"p{i}", "max_new_tokens": 3 + i}} for i in range(5)]
    lines.append({"id": "bad", "inputs": {"prompt": "x", "max_new_tokens": 21}})
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["predict", "--config", str(cfg), "--file", str(f)]) == 1
    out, err = capsys.readouterr()
    res = [msgspec.json.decode(line, type=Result) for line in out.splitlines()]
    assert [r.id for r in res] == [f"r{i}" for i in range(5)] + ["bad"]
    for i, r in enumerate(res[:5]):
        assert r.status == "ok" and r.model == "synthetic-lm"
        assert r.outputs["generated_tokens"] == 3 + i and r.outputs["finish_reason"] == "length"
        assert len(r.outputs["token_ids"]) == 3 + i and r.outputs["prompt_tokens"] == 2
    assert res[5].status == "error" and "$.inputs.max_new_tokens: 21" in (res[5].error or "")
    assert "1 of 6 request(s) failed" in err


def test_profile_reports_steps_per_number_of_sequences(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "synthetic-lm", "--option", "a_ms=0.2", "--option", "b_ms=0.1",
                 "--batch-sizes", "1,4", "--iters", "3", "--warmup", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "one decode step over N running sequences" in out
    assert "recommended model.generation.max_sequences: " in out and "tokens/s" in out
