"""Built-in handlers, the registry and the user-model loaders (factory, TorchScript, torch.export, ONNX,
state dicts), on CPU with tiny models written to tmp_path."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from schemas import Request
from tests.support import needs
from worker.config.settings import ConfigError, ModelConfig
from worker.core.ports import Model
from worker.models.registry import builtin_input_types, load_model

torch.set_num_threads(1)


def run(model: Any, inputs: list[Any]) -> list[Any]:
    items = [model.decode(x) for x in inputs]
    return model.split(model.forward(model.collate(items)), len(items))


def decode_request(model: Any, raw: bytes) -> Any:
    return msgspec.json.decode(raw, type=Request[model.input_type])


# ---------------------------------------------------------------------------------------------- built-ins


def test_builtin_input_types_cover_builtins_and_export_schemas() -> None:
    types = builtin_input_types()
    assert set(types) == {"causal-lm", "identity", "minilm", "synthetic", "synthetic-lm", "tiny", "tiny-lm"}
    for t in types.values():
        msgspec.json.schema(Request[t])  # type: ignore[valid-type]  # exportable


@pytest.mark.parametrize("name", ["identity", "tiny", "synthetic"])
def test_builtins_implement_the_protocol_and_run(name: str) -> None:
    m: Any = load_model(ModelConfig(name=name))
    implements = isinstance(m, Model)  # (an assert isinstance would narrow m for mypy)
    assert implements
    m.setup("cpu")
    ex = m.example_inputs()
    out = run(m, ex)
    assert len(out) == len(ex)
    msgspec.json.encode(out)  # JSON-encodable


def test_identity_echoes_any_json() -> None:
    m = load_model(ModelConfig(name="identity"))
    req = decode_request(m, b'{"id": "1", "inputs": {"a": [1, "x", null]}}')
    assert run(m, [req.inputs, 3, "s"]) == [{"a": [1, "x", None]}, 3, "s"]


def test_tiny_is_deterministic_and_validates_dim() -> None:
    a, b = load_model(ModelConfig(name="tiny")), load_model(ModelConfig(name="tiny"))
    a.setup("cpu")
    b.setup("cpu")
    x = [[0.1] * 16, [0.5] * 16]
    oa, ob = run(a, x), run(b, x)
    assert oa == ob and len(oa[0]) == 4 and abs(sum(oa[0]) - 1) < 1e-5
    decode_request(a, msgspec.json.encode({"id": "1", "inputs": [0.0] * 16}))
    with pytest.raises(msgspec.ValidationError, match="length"):
        decode_request(a, msgspec.json.encode({"id": "1", "inputs": [0.0] * 15}))



def test_tiny_refuses_inputs_that_are_not_finite_in_float32() -> None:
    """NaN or inf (msgpack carries them) or 1e39 (inf as a float32) ran and came back as [null, null, null,
    null] in an ok result; each is a decode error of its record now."""
    import math

    m: Any = load_model(ModelConfig(name="tiny"))
    m.setup("cpu")
    raws = [
        msgspec.msgpack.encode({"id": "1", "inputs": [bad] + [0.0] * 15})
        for bad in (math.nan, math.inf, -math.inf)
    ]
    reqs = [msgspec.msgpack.decode(raw, type=Request[m.input_type]) for raw in raws]
    reqs.append(decode_request(m, b'{"id": "2", "inputs": [0' + b", 0" * 14 + b", -1e39]}"))
    for req in reqs:
        with pytest.raises(ValueError, match="finite float32"):
            m.decode(req.inputs)
    assert m.decode([3.4028234663852886e38, -1e-45] + [0.0] * 14)  # float32's largest and smallest are fine

def test_synthetic_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    m: Any = load_model(ModelConfig(name="synthetic", options={"a_ms": 0, "b_ms": 0, "fail_on": "BAD",
                                                                "oom_above": 2, "crash_on": "DIE"}))
    assert run(m, [{"x": 1}, "ok"]) == [{"x": 1}, "ok"]
    with pytest.raises(ValueError, match="poison"):
        run(m, [{"x": "BAD"}])
    with pytest.raises(RuntimeError, match="out of memory") as ei:
        run(m, [1, 2, 3])
    assert isinstance(ei.value, torch.cuda.OutOfMemoryError)
    exits: list[int] = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    run(m, ["DIE"])
    assert exits == [137]


def test_synthetic_cost_model_sleeps_a_plus_b_n() -> None:
    m: Any = load_model(ModelConfig(name="synthetic", options={"a_ms": 1, "b_ms": 0.5}))
    import time

    t = time.perf_counter()
    run(m, list(range(20)))
    assert time.perf_counter() - t >= 0.011


def test_synthetic_host_ms_is_cpu_time_spent_in_collate() -> None:
    import time

    m: Any = load_model(ModelConfig(name="synthetic", options={"a_ms": 0, "b_ms": 0, "host_ms": 2}))
    assert m.version.endswith("-h2")
    t = time.thread_time()
    m.collate(list(range(10)))
    assert time.thread_time() - t >= 0.020  # 10 records x 2 ms of this thread's own CPU
    t = time.thread_time()
    m.forward([m.decode(1), m.decode(2)])
    assert time.thread_time() - t < 0.020  # the device part stays a sleep
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.host_ms: Expected `float` >= 0"):
        load_model(ModelConfig(name="synthetic", options={"host_ms": -1}))


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (ModelConfig(name="nope"), r"\$\.model\.name: unknown model 'nope'; expected a built-in"),
        (ModelConfig(name="missing.onnx"), r"\$\.model\.name: file 'missing.onnx' not found"),
        (ModelConfig(name="no_such_module_xyz:f"), r"\$\.model\.name: cannot import 'no_such_module_xyz'"),
        (ModelConfig(name="os.path:nope"), r"\$\.model\.name: module 'os.path' has no attribute 'nope'"),
        (ModelConfig(name="synthetic", options={"bogus": 1}), r"\$\.model\.options\.bogus: unknown option"),
        (ModelConfig(name="synthetic", options={"a_ms": "x"}), r"\$\.model\.options\.a_ms: Expected `float"),
        (ModelConfig(name="identity", options={"x": 1}), r"\$\.model\.options\.x: unknown option"),
    ],
)
def test_clear_errors(cfg: ModelConfig, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_model(cfg)
    assert issubclass(ConfigError, ValueError)


def test_version_override() -> None:
    assert load_model(ModelConfig(name="tiny", version="v7")).version == "v7"


# -------------------------------------------------------------------------------------------- user models


class Doubler(torch.nn.Module):
    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


class PerRecordList(torch.nn.Module):
    """Returns one output per record as a list (``list(x)``, ``unbind``), or a torchvision-style list of
    dicts."""

    def __init__(self, dicts: bool = False) -> None:
        super().__init__()
        self.dicts = dicts

    def forward(self, x: torch.Tensor) -> Any:
        if self.dicts:
            return [{"boxes": r.reshape(-1, 2), "score": r.sum()} for r in x]
        return list(x * 10)


def test_a_list_output_is_one_output_per_record_not_heads() -> None:
    """split_rows read a list as heads and transposed it: with a batch as wide as a record (4 x 4), record 0
    got the first value of every record's output, record 1 the second..., all returned as ok."""
    from worker.device.engine import Engine, OutputCountError
    from worker.models.base import split_rows
    from worker.models.loaders import TensorModel

    m = TensorModel(PerRecordList(), name="perrow")
    eng = Engine(m, "cpu", warmup=False, threads=1)
    eng.setup()
    for n in (4, 3, 1):
        items = [m.decode([float(i), i + 0.25, i + 0.5, i + 0.75]) for i in range(n)]
        assert eng.infer(items) == [[10.0 * i, 10 * i + 2.5, 10 * i + 5, 10 * i + 7.5] for i in range(n)]
    assert eng.stats.poison == 0
    det = TensorModel(PerRecordList(dicts=True), name="det")
    assert run(det, [[1, 2, 3, 4], [5, 6, 7, 8]]) == [
        {"boxes": [[1.0, 2.0], [3.0, 4.0]], "score": 10.0}, {"boxes": [[5.0, 6.0], [7.0, 8.0]],
                                                             "score": 26.0}]
    # Heads go in a tuple or dict, as documented; a list of another length than the batch is refused, naming
    # that.
    assert split_rows((torch.zeros(3, 2), torch.ones(3)), 3)[1] == [[0.0, 0.0], 1.0]
    with pytest.raises(OutputCountError, match="list of 2 for a batch of 3.*tuple"):
        split_rows([torch.zeros(3, 2), torch.ones(3)], 3)
    # A list inside a dict is per record too, and must have one item per record.
    assert split_rows({"ids": [torch.tensor([1]), torch.tensor([2, 3])]}, 2) == [{"ids": [1]},
                                                                                 {"ids": [2, 3]}]
    with pytest.raises(ValueError, match=r"output\['ids'\] has 1 rows for a batch of 2"):
        split_rows({"ids": [torch.tensor([1])]}, 2)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "my_models.py").write_text(textwrap.dedent('''
        import torch
        from typing import Any

        class Lin(torch.nn.Module):
            def __init__(self, dim: int = 3):
                super().__init__()
                self.lin = torch.nn.Linear(dim, 2)
            def forward(self, x):
                return self.lin(x)

        def build(dim: int = 3):
            torch.manual_seed(0)
            return Lin(dim)

        class Upper:
            name = "upper"
            version = "1"
            input_type = str
            output_type = str
            def setup(self, device): pass
            def decode(self, inputs): return inputs
            def collate(self, items): return list(items)
            def forward(self, batch): return [s.upper() for s in batch]
            def split(self, output, n): return output

        def not_a_model():
            return 42

        def missing_weights(dim: int = 3):
            raise FileNotFoundError("weights.bin")

        def buggy(dim: int = 3):
            return len(None)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_models"
    sys.modules.pop("my_models", None)


def test_factory_returning_a_handler(user_module: str) -> None:
    m = load_model(ModelConfig(name=f"{user_module}:Upper"))
    assert m.name == "upper" and run(m, ["a", "b"]) == ["A", "B"]


def test_factory_returning_a_module_is_wrapped(user_module: str) -> None:
    m: Any = load_model(ModelConfig(name=f"{user_module}:build", options={"dim": 4, "input_shape": [4]}))
    m.setup("cpu")
    out = run(m, [[1, 2, 3, 4], [0, 0, 0, 0]])
    assert len(out) == 2 and len(out[0]) == 2
    with pytest.raises(ValueError, match=r"shape \[4\], got \[3\]"):
        m.decode([1, 2, 3])
    with pytest.raises(ValueError, match=r"\(nested\) list of numbers"):
        m.decode(["x"])
    assert m.example_inputs() == [[0.0] * 4]


def test_factory_errors(user_module: str) -> None:
    with pytest.raises(ConfigError, match="expected a torch.nn.Module or a handler"):
        load_model(ModelConfig(name=f"{user_module}:not_a_model"))
    with pytest.raises(ConfigError, match=r"\$\.model\.options: factory .* rejected options \['nope'\]"):
        load_model(ModelConfig(name=f"{user_module}:build", options={"nope": 1}))



def test_an_error_inside_a_factory_is_a_config_error_that_says_it_raised(user_module: str,
                                                                         tmp_path: Path) -> None:
    """A TypeError raised in a factory's body was reported as the factory rejecting the options; any other
    exception escaped load_model as a traceback instead of a ConfigError naming $.model (exit 2)."""
    with pytest.raises(ConfigError, match=r"^\$\.model\.name: factory '.*:buggy' raised TypeError: object of "
                                          r"type"):
        load_model(ModelConfig(name=f"{user_module}:buggy", options={"dim": 4}))
    with pytest.raises(ConfigError, match=r"^\$\.model\.name: factory .* raised FileNotFoundError: "
                                          r"weights.bin"):
        load_model(ModelConfig(name=f"{user_module}:missing_weights"))
    with pytest.raises(ConfigError, match=r"\$\.model\.options: factory .*:buggy' rejected options "
                                          r"\['dims'\]: got an unexpected keyword argument 'dims'"):
        load_model(ModelConfig(name=f"{user_module}:buggy", options={"dims": 4}))
    sd = tmp_path / "w.safetensors"
    sd.write_bytes(b"")
    with pytest.raises(ConfigError,
                       match=r"^\$\.model\.options\.factory: factory .* raised FileNotFoundError"):
        load_model(ModelConfig(name=str(sd), options={"factory": f"{user_module}:missing_weights"}))

def test_state_dict_with_factory(user_module: str, tmp_path: Path) -> None:
    torch.manual_seed(1)
    ref = Doubler(3)
    sd_path = tmp_path / "w.pt"
    inner = {"lin.weight": ref.lin.weight.detach().clone(), "lin.bias": ref.lin.bias.detach().clone()}
    torch.save(inner, sd_path)
    m: Any = load_model(ModelConfig(name=f"{user_module}:build", options={"state_dict": str(sd_path)}))
    m.setup("cpu")
    x = [[1.0, 2.0, 3.0]]
    assert torch.allclose(torch.tensor(run(m, x)), ref.lin(torch.tensor(x)), atol=1e-6)
    assert len(m.version) == 12  # content hash of the weights
    # the same weights via name=<file> + options.factory
    m2: Any = load_model(ModelConfig(name=str(sd_path), options={"factory": f"{user_module}:build"}))
    m2.setup("cpu")
    assert run(m2, x) == run(m, x)
    # weights_only=True: a pickled object that is not plain tensors is refused, as a config error (exit 2)
    torch.save({"lin.weight": Doubler(3)}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.state_dict: .*evil.pt' is not a loadable "
                                          r"state dict"):
        load_model(ModelConfig(name=f"{user_module}:build",
                               options={"state_dict": str(tmp_path / "evil.pt")}))
    # so is a whole module saved instead of its state_dict (name=<file> + factory: the key is $.model.name)
    torch.save(Doubler(3), tmp_path / "module.pt")
    with pytest.raises(ConfigError, match=r"\$\.model\.name: .*module.pt' is not a loadable state "
                                          r"dict.*state_dict\(\)"):
        load_model(ModelConfig(name=str(tmp_path / "module.pt"), options={"factory": f"{user_module}:build"}))
    (tmp_path / "broken.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="is not a loadable state dict"):
        load_model(ModelConfig(name=str(tmp_path / "broken.safetensors"),
                               options={"factory": f"{user_module}:build"}))


def test_a_weights_only_file_without_factory_is_refused_before_start(tmp_path: Path) -> None:
    from worker.models.registry import check_model

    path = tmp_path / "w.safetensors"
    path.write_bytes(b"")
    for check in (check_model, load_model):
        with pytest.raises(ConfigError, match=r"\$\.model\.name: 'w.safetensors' holds weights only; set "
                                              r"options.factory"):
            check(ModelConfig(name=str(path)))


def test_an_integer_input_dtype_refuses_fractions_instead_of_truncating(tmp_path: Path) -> None:
    from worker.models.loaders import TensorModel

    m = TensorModel(torch.nn.Identity(), name="ids", input_dtype="int64")
    assert m.decode([1, 2, 3]).tolist() == [1, 2, 3] and m.decode([1.0, 2.0]).tolist() == [1, 2]
    with pytest.raises(ValueError, match="int64: got non-integers"):
        m.decode([1.7, -2.9])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torchscript_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mod = Doubler(3).eval()
    path = tmp_path / "m.ts"
    torch.jit.save(torch.jit.trace(mod, torch.zeros(1, 3)), str(path))
    m: Any = load_model(ModelConfig(name=str(path)))
    m.setup("cpu")
    x = [[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]]
    assert torch.allclose(torch.tensor(run(m, x)), mod(torch.tensor(x)), atol=1e-6)
    assert m.name == "m.ts"


def test_not_torchscript_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(1)}, p)
    with pytest.raises(ConfigError, match="not a TorchScript file.*options.factory"):
        load_model(ModelConfig(name=str(p)))


def test_torch_export_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mod = Doubler(3).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    ep = torch.export.export(mod, (torch.zeros(2, 3),), dynamic_shapes=({0: batch},))
    path = tmp_path / "m.pt2"
    torch.export.save(ep, str(path))
    m: Any = load_model(ModelConfig(name=str(path), options={"input_shape": [3]}))
    m.setup("cpu")
    x = [[1.0, 2.0, 3.0], [0.0, 1.0, 0.0], [4.0, 4.0, 4.0]]
    assert torch.allclose(torch.tensor(run(m, x)), mod(torch.tensor(x)), atol=1e-6)
    assert m.max_batch is None  # a dynamic batch axis: any batch size


def test_a_torch_export_file_with_a_static_batch(tmp_path: Path) -> None:
    """Exported without dynamic_shapes, the batch size is baked in: at 2 it used to load, then fail or not
    depending on the size of each batch (records went to the DLQ at random). Refused at load; 1 runs alone."""
    mod = Doubler(3).eval()
    for n in (2, 1):
        torch.export.save(torch.export.export(mod, (torch.zeros(n, 3),)), str(tmp_path / f"b{n}.pt2"))
    with pytest.raises(ConfigError, match=r"'b2.pt2' has a fixed batch axis of \[2\].*dynamic_shapes"):
        load_model(ModelConfig(name=str(tmp_path / "b2.pt2"), options={"input_shape": [3]}))
    one: Any = load_model(ModelConfig(name=str(tmp_path / "b1.pt2"), options={"input_shape": [3]}))
    assert one.max_batch == 1


def _onnx_linear(path: Path, w: list[list[float]], b: list[float], batch: str | int = "batch") -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["y"])],
        "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2])],
        [numpy_helper.from_array(np.asarray(w, dtype=np.float32), "W"),
         numpy_helper.from_array(np.asarray(b, dtype=np.float32), "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_onnx_file(tmp_path: Path) -> None:
    needs.module("onnxruntime")  # the "onnx" extra
    path = tmp_path / "lin.onnx"
    _onnx_linear(path, [[1, 0], [0, 1], [1, 1]], [0.5, -0.5])
    m: Any = load_model(ModelConfig(name=str(path)))
    m.setup("cpu")
    out = run(m, [[1, 2, 3], [0, 0, 0]])
    assert out == [[4.5, 4.5], [0.5, -0.5]]
    assert m.example_inputs() == [[0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        m.decode([1, 2])



def _onnx_identity(path: Path, elem_type: int, width: int, input_name: str = "ids") -> None:
    """An ONNX file whose one input (``[batch, width]`` of ``elem_type``) is its output."""
    import onnx
    from onnx import helper

    graph = helper.make_graph([helper.make_node("Identity", [input_name], ["out"])], "id",
                              [helper.make_tensor_value_info(input_name, elem_type, ["batch", width])],
                              [helper.make_tensor_value_info("out", elem_type, ["batch", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_an_onnx_integer_input_refuses_fractions_instead_of_truncating(tmp_path: Path) -> None:
    """np.asarray([1.7, 2.9], dtype=int64) is [1, 2]: such records ran, silently truncated (TensorModel
    refuses them)."""
    needs.module("onnxruntime")
    from onnx import TensorProto

    _onnx_identity(tmp_path / "ids.onnx", TensorProto.INT64, 3)
    m: Any = load_model(ModelConfig(name=str(tmp_path / "ids.onnx")))
    m.setup("cpu")
    assert run(m, [[1, 2, 3], [4.0, 5.0, -6.0]]) == [[1, 2, 3], [4, 5, -6]]
    for bad in ([1.7, 2.9, -0.5], [1, 2, 3.5]):
        with pytest.raises(ValueError, match=r"inputs\['ids'\] .*int64: got non-integers"):
            m.decode(bad)
    with pytest.raises(ValueError, match=r"inputs\['ids'\] must be a \(nested\) list of numbers"):
        m.decode([2**70, 1, float("nan")])

def test_onnx_missing_runtime_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lin.onnx"
    path.write_bytes(b"not really onnx")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'kafka-inference-worker\[onnx\]'"):
        load_model(ModelConfig(name=str(path)))


def test_unsupported_file_suffix(tmp_path: Path) -> None:
    p = tmp_path / "m.txt"
    p.write_text("x")
    with pytest.raises(ConfigError, match=r"\$\.model\.name: unknown model"):
        load_model(ModelConfig(name=str(p)))


def test_docs_custom_model_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler example and YAML block in README's Models section load and run as written."""
    import re

    import yaml

    from tests.support.readme import section
    from worker.device.engine import Engine

    doc = section("models")
    code = re.search(r"```python\n(.*?)```", doc, re.S)
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert code and block
    (tmp_path / "my_models.py").write_text(code.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = msgspec.convert(yaml.safe_load(block.group(1))["model"], ModelConfig)
        m: Any = load_model(cfg)
        eng = Engine(m, "cpu", dtype=cfg.dtype, threads=1)
        eng.setup()
        req = decode_request(m, b'{"id": "1", "inputs": {"values": [1, 2, 3, 4, 5, 6, 7, 8]}}')
        out = eng.infer([m.decode(req.inputs)] * 3)
        assert len(out) == 3 and all(isinstance(o, float) for o in out)
    finally:
        sys.modules.pop("my_models", None)


def test_an_onnx_file_with_a_fixed_batch_axis(tmp_path: Path) -> None:
    """torch.onnx.export without dynamic_axes fixes the batch axis. Size 1 used to run every batch into an
    error and bisect it down to single records; now the engine caps every lane at 1. Any other fixed size
    cannot take a stream's partial batches: refused at load."""
    needs.module("onnxruntime")
    from worker.device.engine import Engine

    one = tmp_path / "one.onnx"
    _onnx_linear(one, [[1, 0], [0, 1], [1, 1]], [0.5, -0.5], batch=1)
    m: Any = load_model(ModelConfig(name=str(one)))
    limits: list[tuple[str, int]] = []
    # With the default warm-up, which ran a batch of 8 and failed: the worker could not start.
    eng = Engine(m, "cpu", max_batch_sizes={"default": 32}, on_limit=lambda ln, n: limits.append((ln, n)))
    eng.setup()
    assert limits == [("default", 1)] and eng.effective_max("default") == 1
    out = eng.infer([m.decode([1, 2, 3])] * 5)
    assert out == [[4.5, 4.5]] * 5 and eng.stats.poison == 0
    from worker.app.profile import profile_engine

    rows = profile_engine(eng, [1, 2, 4], iters=2, warmup=1)  # worker profile: sizes over 1 are skipped
    assert [r.status for r in rows] == ["ok"] + ["skipped: the model takes at most 1 per batch"] * 2
    four = tmp_path / "four.onnx"
    _onnx_linear(four, [[1, 0], [0, 1], [1, 1]], [0.5, -0.5], batch=4)
    with pytest.raises(ConfigError, match=r"fixed batch axis of \[4\].*dynamic batch axis"):
        load_model(ModelConfig(name=str(four)))


def test_an_onnx_input_type_the_loader_does_not_map_is_refused_at_load(tmp_path: Path) -> None:
    needs.module("onnxruntime")
    from onnx import TensorProto

    _onnx_identity(tmp_path / "i16.onnx", TensorProto.INT16, 2, input_name="x")
    with pytest.raises(ConfigError, match=r"input 'x' has type tensor\(int16\), which the ONNX loader does "
                                          r"not map"):
        load_model(ModelConfig(name=str(tmp_path / "i16.onnx")))


def test_an_onnx_file_with_a_dynamic_sequence_axis_batches_records_of_different_lengths(
    tmp_path: Path,
) -> None:
    """A symbolic non-batch axis: records of different lengths cannot be stacked. Every mixed batch used to
    fail np.stack and be bisected to single records (one session.run per record, silently); now it runs
    one session.run per distinct shape and the rows go back in input order."""
    needs.module("onnxruntime")
    import onnx
    from onnx import TensorProto, helper

    from worker.device.engine import Engine

    graph = helper.make_graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)], "sum",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
                              [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "sum.onnx"))
    m: Any = load_model(ModelConfig(name=str(tmp_path / "sum.onnx")))
    eng = Engine(m, "cpu", warmup=False)
    eng.setup()
    runs: list[int] = []
    session = m.session

    class Counting:
        def run(self, names: Any, feeds: dict[str, Any]) -> Any:
            runs.append(len(feeds["x"]))
            return session.run(names, feeds)

    m.session = Counting()
    inputs = [[float(i)] * (1 + i % 3) for i in range(12)]  # lengths 1, 2, 3, 1, 2, 3, ...
    items = [m.decode(x) for x in inputs]
    assert [m.size_of(it) for it in items[:3]] == [1, 2, 3]  # for batching.bucket_width
    out = eng.infer(items)
    assert out == [[sum(x)] for x in inputs]
    assert sorted(runs) == [4, 4, 4] and eng.stats.poison == 0
    runs.clear()
    assert eng.infer(items[:2:]) == [[0.0], [2.0]] and sorted(runs) == [1, 1]
    runs.clear()
    assert eng.infer([items[1], items[4]]) == [[2.0], [8.0]] and runs == [2]  # one shape: one stack


@pytest.mark.parametrize("source, wanted", [
    ("def f(:\n", r"importing 'broken_mod' failed: SyntaxError: "),
    ("raise RuntimeError('no GPU driver')\n", r"importing 'broken_mod' failed: RuntimeError: no GPU driver"),
])
def test_a_factory_module_that_fails_to_import_is_a_config_error(source: str, wanted: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Not only a missing module: one that is there but broken is the config's (and its author's) to fix,
    # exit 2 with the key, not a traceback through importlib.
    (tmp_path / "broken_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_mod", raising=False)
    with pytest.raises(ConfigError, match=r"^\$\.model\.name: " + wanted):
        load_model(ModelConfig(name="broken_mod:f"))


@pytest.mark.parametrize(("name", "options", "key"), [
    ("synthetic", {"a_ms": -1}, "a_ms"), ("synthetic", {"b_ms": float("inf")}, "b_ms"),
    ("synthetic", {"host_ms": float("nan")}, "host_ms"), ("synthetic", {"oom_above": -1}, "oom_above"),
    ("tiny", {"hidden": 0}, "hidden"), ("tiny", {"hidden": -3}, "hidden"),
])
def test_a_built_in_option_out_of_range_is_a_config_error_naming_it(name: str, options: dict[str, Any],
                                                                    key: str) -> None:
    # They raised ValueError, ZeroDivisionError or a torch RuntimeError (exit 1, a traceback), or passed (inf,
    # NaN) and failed every forward; README promises exit 2 naming the key.
    with pytest.raises(ConfigError, match=rf"^\$\.model\.options\.{key}: "):
        load_model(ModelConfig(name=name, options=options))
