"""``causal-lm``: any Hugging Face causal LM folder as a ``StepModel`` (per-sequence KV caches, batched
decode).

``HFStepModel`` keeps every started sequence's KV cache in a *block*: the caches of a few sequences, one
row each, left-padded to the longest (an attention mask hides the padding; position ids count each row's
own tokens). ``step(ids)`` runs the prompts of the new sequences in one forward (their prefill, a new
block) and then one batched decode forward over the others. When the set of decoding sequences is the one the
previous step decoded, their block is used as it is; when sequences join or leave, the blocks involved are cut
and joined into one (one copy of those caches). A released sequence's row is dropped at the next such rebuild,
or at once when nothing else lives in its block.

Sampling runs per sequence: greedy (argmax) at temperature 0; otherwise temperature and top-p on the CPU
with the sequence's own ``torch.Generator``, seeded by ``GenParams.seed`` or else the sequence id, so a
seeded sequence draws the same tokens whatever else runs in its batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
import torch

from worker.config.settings import ConfigError
from worker.core.step_model import GenParams, StepModel
from worker.models.base import Options, parse_options

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str, device: str) -> torch.dtype:
    """``auto``: float32 on the CPU, bfloat16 on CUDA; else ``float32``, ``float16`` or ``bfloat16``."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"$.model.options.dtype: unknown dtype {name!r} (allowed: auto, "
                          f"{', '.join(_DTYPES)})")
    return _DTYPES[name]


class _Seq:
    """One started sequence: what the next forward feeds it, how many tokens its cache holds, its sampler."""

    __slots__ = ("block", "feed", "gen", "length", "params")

    def __init__(self, prompt: list[int], params: GenParams, seed: int) -> None:
        self.params = params
        self.feed = prompt  # the prompt before the prefill, then the last sampled token
        self.length = 0  # tokens in the cache
        self.block: _Block | None = None  # None until the prefill
        self.gen: torch.Generator | None = None
        if params.temperature > 0:
            self.gen = torch.Generator().manual_seed(seed)


class _Block:
    """The caches of ``rows`` (None: released), each layer a (keys, values) pair of [rows, heads, T, dim];
    row i is left-padded by ``pads[i]`` positions."""

    __slots__ = ("cache", "pads", "rows")

    def __init__(self, cache: Any, rows: list[int | None], pads: list[int]) -> None:
        self.cache, self.rows, self.pads = cache, rows, pads

    def live(self) -> list[int]:
        return [r for r in self.rows if r is not None]

    def width(self) -> int:
        return int(self.cache.layers[0].keys.shape[-2])


class HFStepModel:
    """A ``StepModel`` over a loaded ``*ForCausalLM`` (full attention, on its device) and its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, max_context: int | None = None) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.model, self.tokenizer = model, tokenizer
        self._config = model.config
        self._cache_type = DynamicCache
        probe = DynamicCache(config=self._config)
        kinds = {type(layer) for layer in probe.layers}
        if kinds and kinds != {DynamicLayer}:
            # Sliding-window layers trim their keys, which breaks the per-row padding the blocks rely on.
            raise ConfigError(
                f"$.model.options.path: {type(model).__name__} uses cache layers "
                f"{sorted(k.__name__ for k in kinds)}; causal-lm steps full-attention models only"
            )
        limit = getattr(self._config.get_text_config(decoder=True), "max_position_embeddings", None)
        self._max_context = min(x for x in (max_context, limit, 1 << 31) if x)
        params = inspect.signature(model.forward).parameters
        self._keep_one = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self._eos = eos[0] if isinstance(eos, list) else eos
        self._seqs: dict[int, _Seq] = {}
        self._blocks: list[_Block] = []
        self._decoding: _Block | None = None  # the block the previous decode ran

    # -- StepModel -----------------------------------------------------------------------------------------

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def max_context(self) -> int:
        return self._max_context

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def start(self, seq_id: int, prompt_ids: Sequence[int], params: GenParams) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already started; release it first")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"sequence {seq_id}: empty prompt (the model needs at least one token)")
        if len(prompt) >= self._max_context:
            raise ValueError(f"sequence {seq_id}: prompt of {len(prompt)} tokens leaves no room in the "
                             f"model's context of {self._max_context}")
        self._seqs[seq_id] = _Seq(prompt, params, seq_id if params.seed is None else params.seed)

    def step(self, seq_ids: Sequence[int]) -> list[int]:
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"step: a sequence appears twice in {ids}")
        for s in ids:
            if s not in self._seqs:
                raise KeyError(f"step: sequence {s} is not started (or was released)")
            if self._seqs[s].length + len(self._seqs[s].feed) > self._max_context:
                raise ValueError(f"step: sequence {s} would pass the model's context of {self._max_context}")
        out: dict[int, int] = {}
        with torch.inference_mode():
            new = [s for s in ids if self._seqs[s].block is None]
            if new:
                out.update(self._prefill(new))
            decoding = [s for s in ids if s not in out]
            if decoding:
                out.update(self._decode(decoding))
        return [out[s] for s in ids]

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None or seq.block is None:
            return
        block = seq.block
        block.rows[block.rows.index(seq_id)] = None
        if not block.live():
            self._blocks.remove(block)
            if self._decoding is block:
                self._decoding = None

    # -- what tests and metrics read -----------------------------------------------------------------------

    def active(self) -> int:
        """Sequences started and not released."""
        return len(self._seqs)

    def cache_bytes(self) -> int:
        """Bytes of KV cache held, padding and not yet dropped released rows included."""
        total = 0
        for b in self._blocks:
            for layer in b.cache.layers:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total

    # -- forward passes ------------------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any) -> Any:
        kw: dict[str, Any] = {"logits_to_keep": 1} if self._keep_one else {}
        kw[self._cache_arg] = cache
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **kw)
        return out.logits[:, -1, :]

    def _prefill(self, ids: list[int]) -> dict[int, int]:
        """The prompts of ``ids`` in one forward, left-padded: a new block, its rows in the order of
        ``ids``."""
        seqs = [self._seqs[s] for s in ids]
        dev = self.model.device
        width = max(len(s.feed) for s in seqs)
        pads = [width - len(s.feed) for s in seqs]
        feed = torch.tensor([[0] * p + s.feed for p, s in zip(pads, seqs, strict=True)], device=dev)
        pad_t = torch.tensor(pads, device=dev)[:, None]
        columns = torch.arange(width, device=dev)[None, :]
        mask = (columns >= pad_t).long()
        positions = (columns - pad_t).clamp(min=0)
        cache = self._cache_type(config=self._config)
        logits = self._forward(feed, mask, positions, cache)
        block = _Block(cache, list(ids), pads)
        self._blocks.append(block)
        tokens = self._sample(logits, seqs)
        for s, t in zip(seqs, tokens, strict=True):
            s.block, s.length, s.feed = block, len(s.feed), [t]
        return dict(zip(ids, tokens, strict=True))

    def _decode(self, ids: list[int]) -> dict[int, int]:
        block = self._gather(ids)
        seqs = [self._seqs[r] for r in block.live()]
        dev = self.model.device
        width = block.width()
        pads = torch.tensor(block.pads, device=dev)
        mask = (torch.arange(width + 1, device=dev)[None, :] >= pads[:, None]).long()
        feed = torch.tensor([s.feed for s in seqs], dtype=torch.long, device=dev)
        positions = torch.tensor([[s.length] for s in seqs], dtype=torch.long, device=dev)
        logits = self._forward(feed, mask, positions, block.cache)
        tokens = self._sample(logits, seqs)
        for s, t in zip(seqs, tokens, strict=True):
            s.length += 1
            s.feed = [t]
        return dict(zip(block.live(), tokens, strict=True))

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            if s.gen is not None:
                tokens[i] = _draw(logits[i].float().cpu(), s.params, s.gen)
        return [int(t) for t in tokens]

    # -- blocks --------------------------------------------------------------------------------------------

    def _gather(self, ids: list[int]) -> _Block:
        """One block holding exactly ``ids`` (in any row order): the previous one when it is that set."""
        wanted = set(ids)
        prev = self._decoding
        if prev is not None and prev in self._blocks and None not in prev.rows and set(prev.rows) == wanted:
            return prev
        parts: list[_Block] = []
        for block in {id(self._seqs[s].block): self._seqs[s].block for s in ids}.values():
            assert block is not None
            self._blocks.remove(block)
            take = [i for i, r in enumerate(block.rows) if r in wanted]
            keep = [i for i, r in enumerate(block.rows) if r is not None and r not in wanted]
            parts.append(self._cut(block, take))
            if keep:
                self._adopt(self._cut(block, keep))
        merged = parts[0] if len(parts) == 1 else self._join(parts)
        self._adopt(merged)
        self._decoding = merged
        return merged

    def _adopt(self, block: _Block) -> None:
        self._blocks.append(block)
        for r in block.live():
            self._seqs[r].block = block

    def _cut(self, block: _Block, rows: list[int]) -> _Block:
        """The given rows of ``block`` as a new block, without the padding columns they all share."""
        if rows == list(range(len(block.rows))) and min(block.pads) == 0:
            return block
        trim = min(block.pads[i] for i in rows)
        index = torch.tensor(rows, device=block.cache.layers[0].keys.device)
        kv = [(layer.keys.index_select(0, index)[:, :, trim:],
               layer.values.index_select(0, index)[:, :, trim:])
              for layer in block.cache.layers]
        return _Block(self._make_cache(kv), [block.rows[i] for i in rows],
                      [block.pads[i] - trim for i in rows])

    def _join(self, parts: list[_Block]) -> _Block:
        width = max(p.width() for p in parts)
        layers = []
        for n in range(len(parts[0].cache.layers)):
            keys, values = [], []
            for p in parts:
                extra = width - p.width()
                layer = p.cache.layers[n]
                keys.append(torch.nn.functional.pad(layer.keys, (0, 0, extra, 0)))
                values.append(torch.nn.functional.pad(layer.values, (0, 0, extra, 0)))
            layers.append((torch.cat(keys), torch.cat(values)))
        rows = [r for p in parts for r in p.rows]
        pads = [pad + width - p.width() for p in parts for pad in p.pads]
        return _Block(self._make_cache(layers), rows, pads)

    def _make_cache(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        cache: Any = self._cache_type(config=self._config)
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k.contiguous(), v.contiguous()
        return cache


def _draw(logits: torch.Tensor, params: GenParams, gen: torch.Generator) -> int:
    """One token from ``softmax(logits / temperature)`` cut to the smallest set of mass >= ``top_p``."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # A token stays when the mass before it is below top_p.
        drop = (sorted_p.cumsum(0) - sorted_p) >= params.top_p
        drop[0] = False  # top_p of 0 keeps the most likely token
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


class CausalLMOptions(Options):
    path: str = ""  # a local Hugging Face model folder (config.json, weights, tokenizer); no hub downloads
    dtype: str = "auto"
    max_context: Annotated[int, msgspec.Meta(ge=2)] | None = None  # a cap below the model's own limit
    attention: str = "sdpa"  # the transformers attention implementation ("sdpa", "eager", ...)


class CausalLM:
    """The ``causal-lm`` generative handler: a local model folder (``path``) loaded in ``setup``."""

    kind: ClassVar[str] = "generative"
    name: ClassVar[str] = "causal-lm"

    def __init__(self, **options: Any) -> None:
        self.options = parse_options(options, CausalLMOptions, self.name)
        folder = Path(self.options.path).expanduser()
        if not self.options.path:
            raise ConfigError("$.model.options.path: required: the folder of a Hugging Face causal LM")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"$.model.options.path: {str(folder)!r} is not a model folder (no config.json)")
        torch_dtype(self.options.dtype, "cpu")
        self.folder = folder
        self.version = folder.resolve().name
        self._step: StepModel | None = None

    def setup(self, device: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = torch_dtype(self.options.dtype, device)
        model: Any = AutoModelForCausalLM.from_pretrained(
            self.folder, local_files_only=True, dtype=dtype, attn_implementation=self.options.attention
        )
        tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        model.to(device)
        model.eval()
        self._step = HFStepModel(model, tokenizer, max_context=self.options.max_context)

    def step_model(self) -> StepModel:
        if self._step is None:
            raise RuntimeError("causal-lm: step_model() before setup(device)")
        return self._step


def causal_lm(**options: Any) -> CausalLM:
    """Factory for ``$.model.name: "worker.models.causal_lm:causal_lm"`` (the built-in name is
    ``causal-lm``)."""
    return CausalLM(**options)
