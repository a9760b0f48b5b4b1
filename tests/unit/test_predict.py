"""``worker predict``: requests through the configured model without Kafka, results as ``worker run``
writes."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from schemas import Result
from worker.app.cli import main

TINY = [0.1 * i for i in range(16)]


def _config(tmp_path: Path, text: str) -> str:
    f = tmp_path / "worker.yaml"
    f.write_text(textwrap.dedent(text))
    return str(f)


def _results(out: str) -> list[Result]:
    return [msgspec.json.decode(line, type=Result) for line in out.splitlines()]


def test_a_request_through_tiny_gets_the_result_envelope(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, "kafka: {input_topics: [requests]}\nmodel: {name: tiny}\n")
    req = json.dumps({"id": "r1", "inputs": TINY, "meta": {"trace": "t-1"}})
    assert main(["predict", "--config", cfg, "--input", req]) == 0
    out, err = capsys.readouterr()
    (res,) = _results(out)
    assert (res.id, res.status, res.model, res.lane, res.batch_size, res.meta) == ("r1", "ok", "tiny",
                                                                                   "default", 1,
                                                                                   {"trace": "t-1"})
    assert res.source.topic == "requests" and res.source.offset == 0
    assert res.model_version == "1-h64-s0"
    assert len(res.outputs) == 4 and abs(sum(res.outputs) - 1.0) < 1e-5
    assert err == ""


def test_a_file_of_requests_keeps_their_order_and_the_lanes_batch_sizes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, """\
        delivery: {format: msgpack}   # predict reads and writes JSON whatever the topics carry
        model: {name: identity}
        batching:
          lanes:
            - {name: default, max_batch_size: 2}
            - {name: high, priority: 1, topics: [urgent]}
        kafka: {input_topics: [requests]}
        """)
    lines = [json.dumps({"id": f"r{i}", "inputs": {"n": i}}) for i in range(5)]
    lines.insert(2, "")  # blank lines are skipped
    lines.append(json.dumps({"id": "hi", "inputs": [1], "priority": "high"}))
    f = tmp_path / "requests.jsonl"
    f.write_text("\n".join(lines) + "\n")
    assert main(["predict", "-c", cfg, "--file", str(f)]) == 0
    res = _results(capsys.readouterr().out)
    assert [r.id for r in res] == ["r0", "r1", "r2", "r3", "r4", "hi"]
    assert [r.outputs for r in res[:5]] == [{"n": i} for i in range(5)]
    assert [r.batch_size for r in res] == [2, 2, 2, 2, 1, 1]  # the default lane's max_batch_size is 2
    assert [r.lane for r in res] == ["default"] * 5 + ["high"]
    assert [r.source.offset for r in res] == list(range(6))


def test_topic_picks_the_lane(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, """\
        model: {name: identity}
        batching: {lanes: [{name: default}, {name: high, topics: [urgent]}]}
        kafka: {input_topics: [requests]}
        """)
    assert main(["predict", "-c", cfg, "--topic", "urgent", "--input", '{"id": "a", "inputs": 1}']) == 0
    (res,) = _results(capsys.readouterr().out)
    assert (res.lane, res.source.topic) == ("high", "urgent")


def test_a_bad_request_gets_its_error_result_and_exit_1(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, "model: {name: tiny}\nkafka: {input_topics: [requests]}\n")
    f = tmp_path / "requests.jsonl"
    f.write_text(json.dumps({"id": "ok", "inputs": TINY}) + "\n" + json.dumps({"id": "short",
                                                                               "inputs": [1.0]})
                 + "\n" + json.dumps({"inputs": "no id"}) + "\n")
    assert main(["predict", "-c", cfg, "-f", str(f)]) == 1
    out, err = capsys.readouterr()
    ok, short, anonymous = _results(out)
    assert ok.status == "ok"
    assert short.status == "error" and "at `$.inputs`" in (short.error or "")
    assert anonymous.id == "" and anonymous.status == "error"  # no id to echo: still one line per request
    assert f"{f} line 2: error (validate): invalid request: Expected `array` of length >= 16" in err
    assert f"{f} line 3: error (validate)" in err
    assert "2 of 3 request(s) failed" in err


def test_a_file_with_lines_that_are_not_json_is_exit_2_naming_each_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.models.registry

    def no_load(_cfg: object) -> None:
        raise AssertionError("the model loads only once the input is known to be readable")

    monkeypatch.setattr(worker.models.registry, "load_model", no_load)
    cfg = _config(tmp_path, "model: {name: tiny}\nkafka: {input_topics: [requests]}\n")
    f = tmp_path / "requests.jsonl"
    f.write_text('{"id": "a", "inputs": []}\n{"id": "b",\n\nnot json\n')
    assert main(["predict", "-c", cfg, "-f", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{f} line 2: not JSON" in err and f"{f} line 4: not JSON" in err and "line 1" not in err


@pytest.mark.parametrize("content, wanted", [
    (None, "cannot read requests file"),
    ("\n \n", "no requests"),
])
def test_a_missing_or_empty_file_is_exit_2(content: str | None, wanted: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, "model: {name: identity}\nkafka: {input_topics: [requests]}\n")
    f = tmp_path / "requests.jsonl"
    if content is not None:
        f.write_text(content)
    assert main(["predict", "-c", cfg, "-f", str(f)]) == 2
    assert wanted in capsys.readouterr().err


def test_a_bad_config_is_exit_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, "model: {name: tiny, options: {hiden: 8}}\nkafka: {input_topics: [requests]}\n")
    assert main(["predict", "-c", cfg, "--input", '{"id": "a", "inputs": []}']) == 2
    assert "$.model.options.hiden: unknown option for model 'tiny'" in capsys.readouterr().err


def test_input_and_file_are_exclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, "model: {name: identity}\nkafka: {input_topics: [requests]}\n")
    with pytest.raises(SystemExit) as e:
        main(["predict", "-c", cfg, "--input", "{}", "--file", "x"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["predict", "-c", cfg])
    assert e.value.code == 2


HANDLER = '''
class Picky:
    """Fails any batch holding a negative number; returns an output JSON cannot hold for 13."""
    name = "picky"
    version = "7"
    def __init__(self): pass
    def setup(self, device): pass
    def decode(self, inputs): return inputs
    def collate(self, items): return list(items)
    def forward(self, batch):
        if any(x < 0 for x in batch):
            raise ValueError("negative input")
        return batch
    def split(self, output, n): return [object() if x == 13 else x * 2 for x in output]
'''


def test_the_engines_and_the_emitters_failure_handling_apply(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "picky_model.py").write_text(HANDLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "picky_model", raising=False)
    cfg = _config(tmp_path, "model: {name: 'picky_model:Picky', warmup: false}\nkafka: {input_topics: "
                            "[requests]}\n")
    f = tmp_path / "requests.jsonl"
    f.write_text("".join(json.dumps({"id": f"r{x}", "inputs": x}) + "\n" for x in (1, -1, 13, 4)))
    assert main(["predict", "-c", cfg, "-f", str(f)]) == 1
    out, err = capsys.readouterr()
    res = _results(out)
    assert [(r.id, r.status) for r in res] == [("r1", "ok"), ("r-1", "error"), ("r13", "error"), ("r4", "ok")]
    assert [res[0].outputs, res[3].outputs] == [2, 8]  # the batch was bisected: the others still ran
    assert res[1].error == "ValueError: negative input"
    assert (res[1].model, res[1].model_version) == ("picky", "7")
    assert (res[2].error or "").startswith("result not encodable")
    assert "line 2: error (inference): ValueError: negative input" in err
    assert "line 3: error (output): result not encodable" in err
