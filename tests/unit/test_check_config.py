"""``worker check-config`` as strict as ``worker run``: factory options, handler classes, every problem at
once, suggestions for unknown keys, and secrets that exist only where the worker runs."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from worker.app.cli import main

MODULE = '''
import torch
from typing import ClassVar

def linear(in_features: int, out_features: int = 2, *, bias: bool = True):
    return torch.nn.Linear(in_features, out_features, bias=bias)

class Mlp(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.net = torch.nn.Linear(width, 1)

class NotAHandler:
    def __init__(self):
        pass

class NoSplit:
    def setup(self, device): pass
    def decode(self, inputs): return inputs
    def collate(self, items): return items
    def forward(self, batch): return batch

class BadAttributes:
    name = 3
    input_type = object()
    def setup(self, device): pass
    def decode(self, inputs): return inputs
    def collate(self, items): return items
    def forward(self, batch): return batch
    def split(self, output, n): return output

class Good:
    name: ClassVar[str] = "good"
    input_type: ClassVar[object] = list[float]
    def __init__(self, scale: float = 1.0): self.scale = scale
    def setup(self, device): pass
    def decode(self, inputs): return inputs
    def collate(self, items): return items
    def forward(self, batch): return batch
    def split(self, output, n): return output
'''


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "byo_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "byo_models", raising=False)
    return tmp_path


def _check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    f = tmp_path / "worker.yaml"
    f.write_text(textwrap.dedent(text))
    rc = main(["check-config", "--config", str(f)])
    out, err = capsys.readouterr()
    return rc, err.splitlines(), out


def test_a_factory_option_typo_is_reported_with_the_name_it_takes(
        models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, out = _check(models, """\
        kafka: {input_topics: [in]}
        model: {name: "byo_models:linear", options: {in_features: 4, out_feature: 3}}
        """, capsys)
    assert rc == 2 and out == ""
    assert err == ["config error: $.model.options.out_feature: factory 'byo_models:linear' takes no option "
                   "'out_feature' (it takes: in_features, out_features, bias); did you mean `out_features`?"]


def test_a_required_factory_option_left_out_is_an_error(models: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(models, """\
        kafka: {input_topics: [in]}
        model: {name: "byo_models:linear", options: {input_shape: [4]}}
        """, capsys)
    assert rc == 2
    assert err == ["config error: $.model.options.in_features: required by factory "
                   "'byo_models:linear', not given"]


def test_a_module_class_is_checked_against_its_init(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(models, """\
        kafka: {input_topics: [in]}
        model: {name: "byo_models:Mlp", options: {widht: 4, input_shape: [0], input_dtype: float8}}
        """, capsys)
    assert rc == 2
    assert err == [
        "config error: $.model.options.input_dtype: expected one of ['bfloat16', 'bool', 'float', 'float16', "
        "'float32', 'float64', 'int32', 'int64', 'long'], got 'float8'",
        "config error: $.model.options.input_shape: expected a list of positive ints, got [0]",
        "config error: $.model.options.widht: factory 'byo_models:Mlp' takes no option 'widht' (it takes: "
        "width); did you mean `width`?",
    ]


def test_a_handler_class_with_none_of_the_five_stages_is_an_error(
        models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(models, "kafka: {input_topics: [in]}\nmodel: {name: 'byo_models:NotAHandler'}\n",
                        capsys)
    assert rc == 2
    assert err == ["config error: $.model.name: 'byo_models:NotAHandler' is a class with none of the handler "
                   "stages: a handler defines setup, decode, collate, forward, split (or make the class a "
                   "torch.nn.Module)"]


def test_a_handler_class_missing_a_stage_names_it(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(models, "kafka: {input_topics: [in]}\nmodel: {name: 'byo_models:NoSplit'}\n", capsys)
    assert rc == 2
    assert err[0].startswith("config error: $.model.name: 'byo_models:NoSplit' is a class "
                             "with no split method")


def test_a_handler_classs_attributes_are_checked(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(models, "kafka: {input_topics: [in]}\nmodel: {name: 'byo_models:BadAttributes'}\n",
                        capsys)
    assert rc == 2
    assert len(err) == 2
    assert "'byo_models:BadAttributes'.input_type <object object at" in err[0]
    assert "cannot validate requests" in err[0]
    assert "'byo_models:BadAttributes'.name is int 3" in err[1]


def test_a_good_handler_class_and_factory_pass(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, options in (("byo_models:Good", "{scale: 2.0}"), ("byo_models:linear", "{in_features: 4}")):
        rc, err, out = _check(models, f"kafka: {{input_topics: [in]}}\nmodel: {{name: '{name}', options: "
                                      f"{options}}}\n",
                              capsys)
        assert (rc, err) == (0, [])
        assert "OK" in out and "factory, importable; called at start" in out


def test_every_problem_is_reported_at_once_sorted_by_path(models: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(models, """\
        kafka: {input_topics: [in], output_topic: in, grup_id: g}
        model: {name: "byo_models:linear", options: {in_features: 4, out_feature: 3}}
        batching:
          lanes:
            - {name: default, max_wait_msx: 3}
            - {name: b, max_batch_size: 0}
            - {name: c}
            - {name: d}
            - {name: e}
            - {name: f}
            - {name: g}
            - {name: h}
            - {name: i}
            - {name: j}
            - {name: k, weigth: 2}
        delivery: {mode: at_most_once}
        metrics: {port: 70000}
        """, capsys)
    assert rc == 2
    assert [line.split(": ", 2)[1] for line in err] == [
        "$.batching.lanes[0].max_wait_msx", "$.batching.lanes[1].max_batch_size",
        "$.batching.lanes[10].weigth",
        "$.delivery.mode", "$.kafka.grup_id", "$.metrics.port", "$.model.options.out_feature"]
    assert "did you mean `max_wait_ms`?" in err[0]
    assert "did you mean `weight`?" in err[2]
    assert "did you mean `group_id`?" in err[4]


def test_across_key_problems_are_all_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, err, _ = _check(tmp_path, """\
        kafka: {input_topics: [in], output_topic: in, dlq_topic: in}
        batching: {default_lane: nope}
        """, capsys)
    assert rc == 2
    assert [line.split(": ", 2)[1] for line in err] == [
        "$.batching.default_lane", "$.kafka.dlq_topic", "$.kafka.dlq_topic", "$.kafka.output_topic"]


@pytest.mark.parametrize("text, wanted", [
    ("bathcing: {}\n", "$.bathcing: unknown key; did you mean `batching`?"),
    ("model: {name: tiny, devise: cpu}\n", "$.model.devise: unknown key; did you mean `device`?"),
    ("redis: {urll: 'redis://h'}\n", "$.redis.urll: unknown key; did you mean `url`?"),
    ("model: {name: tiny, options: {hiden: 3}}\n",
     "$.model.options.hiden: unknown option for model 'tiny' (allowed: hidden, seed); "
     "did you mean `hidden`?"),
    ("zzz: 1\n", "$.zzz: unknown key"),  # nothing close: no guess
])
def test_unknown_keys_anywhere_get_the_closest_known_name(text: str, wanted: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, _ = _check(tmp_path, "kafka: {input_topics: [in]}\n" + text, capsys)
    assert (rc, err) == (2, [f"config error: {wanted}"])


SECRETS = """\
    kafka:
      input_topics: [in]
      consumer: {security.protocol: SASL_SSL, sasl.mechanisms: PLAIN, sasl.username: u,
                 sasl.password: "${env:KIW_TEST_ABSENT_PW}", ssl.ca.location: /nonexistent/ca.pem}
    redis: {url: "${file:/nonexistent/redis-url}"}
    """


def test_secrets_not_here_are_notes_in_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KIW_TEST_ABSENT_PW", raising=False)
    rc, err, out = _check(tmp_path, SECRETS, capsys)
    assert rc == 0, err
    assert "OK" in out
    assert err == [
        "note: $.kafka.consumer.sasl.password: environment variable 'KIW_TEST_ABSENT_PW' is not set (not "
        "checked here; `worker run` without it exits 2)",
        "note: $.redis.url: cannot read secret file '/nonexistent/redis-url': No such file or directory (not "
        "checked here; `worker run` without it exits 2)",
        "note: $.kafka.consumer.ssl.ca.location: /nonexistent/ca.pem is not on this machine (not checked; "
        "`worker run` here would exit 2)",
    ]


def test_secrets_not_here_are_errors_in_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.app.service

    def never(*_a: object, **_k: object) -> int:
        raise AssertionError("run must stop at the config")

    monkeypatch.setattr(worker.app.service, "run_service", never)
    monkeypatch.delenv("KIW_TEST_ABSENT_PW", raising=False)
    f = tmp_path / "worker.yaml"
    f.write_text(textwrap.dedent(SECRETS))
    assert main(["run", "--config", str(f)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "config error: $.kafka.consumer.sasl.password: environment variable 'KIW_TEST_ABSENT_PW' is not set",
        "config error: $.kafka.consumer.ssl.ca.location: no such file on this machine: /nonexistent/ca.pem",
        "config error: $.redis.url: cannot read secret file '/nonexistent/redis-url': No "
        "such file or directory",
    ]


def test_a_present_secret_is_checked_as_its_value(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url = tmp_path / "redis-url"
    url.write_text("http://not-redis\n")
    monkeypatch.setenv("KIW_TEST_ABSENT_PW", "pw")
    rc, err, _ = _check(tmp_path, SECRETS.replace("/nonexistent/redis-url", str(url)), capsys)
    assert rc == 2
    assert err[-1].startswith("config error: $.redis.url: expected redis://")
