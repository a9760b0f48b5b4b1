"""``tiny-lm``: a small Llama-shaped causal LM with seeded random weights and a byte-level tokenizer.

Nothing is downloaded: the config, the weights (from a private seeded generator) and the tokenizer (one
token per byte, plus ``<eos>``, ``<pad>`` and ``<bos>``) are built in code, so the same options give the
same model everywhere. ``save_tiny_lm(folder)`` writes it as a Hugging Face folder, which ``causal-lm``
loads through its ``path`` option. Its text is noise; it exists for tests, the bench and the demo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec

from worker.config.settings import ConfigError
from worker.core.step_model import StepModel
from worker.models.base import Options, parse_options

BYTE_TOKENS = 256  # ids 0-255 are the bytes themselves
EOS, PAD, BOS = "<eos>", "<pad>", "<bos>"  # ids 256, 257, 258


class TinyLMOptions(Options):
    layers: Annotated[int, msgspec.Meta(ge=1, le=32)] = 2
    hidden: Annotated[int, msgspec.Meta(ge=8, le=4096)] = 64
    heads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    kv_heads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    intermediate: Annotated[int, msgspec.Meta(ge=8, le=16_384)] = 128
    max_context: Annotated[int, msgspec.Meta(ge=2, le=32_768)] = 512
    seed: int = 0
    dtype: str = "auto"  # as causal-lm's option: auto (float32 on CPU, bfloat16 on CUDA) or a torch dtype


def tiny_options(**options: Any) -> TinyLMOptions:
    """The options, checked: heads divide ``hidden`` into an even head size, ``kv_heads`` divides
    ``heads``."""
    opts = parse_options(options, TinyLMOptions, "tiny-lm")
    if opts.hidden % opts.heads or (opts.hidden // opts.heads) % 2:
        raise ConfigError(f"$.model.options.heads: {opts.heads} heads must split hidden {opts.hidden} "
                          "into heads of an even size (rotary embeddings pair the dimensions)")
    if opts.heads % opts.kv_heads:
        raise ConfigError(f"$.model.options.kv_heads: {opts.kv_heads} must divide heads ({opts.heads})")
    from worker.models.causal_lm import torch_dtype

    torch_dtype(opts.dtype, "cpu")  # a bad name fails here, with the option's path
    return opts


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as one printable character (what ByteLevel expects)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose id ``i < 256`` is byte ``i``; any text encodes, nothing is
    unknown."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    for i, special in enumerate((EOS, PAD, BOS)):
        vocab[special] = BYTE_TOKENS + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in (EOS, PAD, BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=BOS)


def build_tiny_lm(opts: TinyLMOptions) -> tuple[Any, Any]:
    """(model, tokenizer): a ``LlamaForCausalLM`` in eval mode on the CPU, float32, seeded weights."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=BYTE_TOKENS + 3, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
        num_hidden_layers=opts.layers, num_attention_heads=opts.heads, num_key_value_heads=opts.kv_heads,
        max_position_embeddings=opts.max_context, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(config)
    # A private generator: building the model leaves the global RNG alone. Weights of scale 1/sqrt(fan_in)
    # (not the 0.02 of training init) give peaked logits, so greedy choices are far from ties.
    g = torch.Generator().manual_seed(opts.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm scales
            else:
                scale = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, do_sample=False,
    )
    model.eval()
    return model, tokenizer


def save_tiny_lm(folder: str | Path, **options: Any) -> Path:
    """Writes the tiny model as a Hugging Face folder (config, safetensors, tokenizer) for ``causal-lm``."""
    model, tokenizer = build_tiny_lm(tiny_options(**options))
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class TinyLM:
    """The ``tiny-lm`` generative handler: builds the model in ``setup``, steps it through ``HFStepModel``."""

    kind: ClassVar[str] = "generative"
    name: ClassVar[str] = "tiny-lm"

    def __init__(self, **options: Any) -> None:
        self.options = tiny_options(**options)
        o = self.options
        self.version = f"1-l{o.layers}-h{o.hidden}-s{o.seed}"
        self._step: StepModel | None = None

    def setup(self, device: str) -> None:
        from worker.models.causal_lm import HFStepModel, torch_dtype

        model, tokenizer = build_tiny_lm(self.options)
        model.to(device=device, dtype=torch_dtype(self.options.dtype, device))
        self._step = HFStepModel(model, tokenizer, max_context=self.options.max_context)

    def step_model(self) -> StepModel:
        if self._step is None:
            raise RuntimeError("tiny-lm: step_model() before setup(device)")
        return self._step


def tiny_lm(**options: Any) -> TinyLM:
    """Factory for ``$.model.name: "worker.models.tiny_lm:tiny_lm"`` (the built-in name is ``tiny-lm``)."""
    return TinyLM(**options)
