"""HFStepModel over tiny-lm: continuous stepping gives what ``generate`` gives each prompt alone; seeded
sampling repeats; released caches are freed; the ``path`` route loads the same model from a folder."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from worker.config.settings import ConfigError
from worker.core.step_model import GenerativeHandler, GenParams, StepModel
from worker.models.causal_lm import CausalLM, HFStepModel, causal_lm
from worker.models.tiny_lm import TinyLM, save_tiny_lm, tiny_lm

PROMPTS = ["hello world", "a", "the quick brown fox jumps over", "zz", "ünïcødé text", "0123456789" * 3]


@cache
def tiny() -> HFStepModel:
    h = TinyLM()
    h.setup("cpu")
    m = h.step_model()
    assert isinstance(m, HFStepModel)
    return m


@cache
def reference(prompt: str, n: int) -> tuple[int, ...]:
    """``generate(do_sample=False)`` on the prompt alone, cut after the first EOS."""
    m = tiny()
    ids = torch.tensor([m.encode(prompt)])
    out = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


def run(m: StepModel, plan: Sequence[tuple[int, str, int]], params: dict[int, GenParams] | None = None,
        pause: Sequence[tuple[int, int]] = ()) -> dict[int, list[int]]:
    """Steps ``plan`` (join step, prompt, max new tokens) continuously: a sequence joins at its step and
    leaves at EOS or its limit; ``(step, i)`` in ``pause`` leaves sequence i out of that step."""
    got: dict[int, list[int]] = {i: [] for i in range(len(plan))}
    active: list[int] = []
    step = 0
    while step <= max(j for j, _, _ in plan) or active:
        for i, (join, prompt, n) in enumerate(plan):
            if join == step:
                m.start(i, m.encode(prompt), (params or {}).get(i, GenParams(max_new_tokens=n)))
                active.append(i)
        now = [i for i in active if (step, i) not in pause]
        if now:
            for i, t in zip(now, m.step(now), strict=True):
                got[i].append(t)
                if t == m.eos_token_id or len(got[i]) >= plan[i][2]:
                    active.remove(i)
                    m.release(i)
        step += 1
    return got


def test_the_handlers_are_generative_handlers_and_their_models_step_models() -> None:
    for h in (TinyLM(), tiny_lm(layers=1)):
        assert isinstance(h, GenerativeHandler) and h.kind == "generative"
    assert h.name == "tiny-lm" and h.version == "1-l1-h64-s0"
    assert isinstance(tiny(), StepModel)
    with pytest.raises(RuntimeError, match="before setup"):
        TinyLM().step_model()


def test_continuous_greedy_stepping_matches_generate_on_each_prompt_alone() -> None:
    plan = [(0, PROMPTS[0], 20), (0, PROMPTS[1], 5), (3, PROMPTS[2], 30), (7, PROMPTS[3], 12),
            (10, PROMPTS[4], 25), (10, PROMPTS[5], 1)]
    # Sequence 2 sits out two steps, so its rows are cut out of a block and joined back.
    got = run(tiny(), plan, pause=[(5, 2), (6, 2), (8, 0)])
    for i, (_, prompt, n) in enumerate(plan):
        assert tuple(got[i]) == reference(prompt, n), i
    assert tiny().active() == 0 and tiny().cache_bytes() == 0


@settings(max_examples=examples(4), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, len(PROMPTS) - 1), st.integers(1, 16)),
                min_size=1, max_size=5))
@example([(0, 0, 1)])
def test_any_join_schedule_matches_generate(plan: list[tuple[int, int, int]]) -> None:
    got = run(tiny(), [(j, PROMPTS[p], n) for j, p, n in plan])
    for i, (_, p, n) in enumerate(plan):
        assert tuple(got[i]) == reference(PROMPTS[p], n), i
    assert tiny().cache_bytes() == 0


def test_seeded_sampling_repeats_whatever_runs_beside_it() -> None:
    m = tiny()
    hot = GenParams(max_new_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    alone = run(m, [(0, PROMPTS[2], 24)], {0: hot})[0]
    again = run(m, [(0, PROMPTS[2], 24)], {0: hot})[0]
    crowd = run(m, [(2, PROMPTS[0], 30), (0, PROMPTS[2], 24), (1, PROMPTS[5], 10)],
                {0: GenParams(max_new_tokens=30, temperature=1.0, seed=1), 1: hot})[1]
    other = run(m, [(0, PROMPTS[2], 24)], {0: GenParams(max_new_tokens=24, temperature=0.9,
                                                        top_p=0.9, seed=8)})
    assert alone == again == crowd
    assert other[0] != alone  # another seed draws other tokens (24 draws from a spread-out distribution)
    assert alone != list(reference(PROMPTS[2], 24)[: len(alone)])  # it samples: not the greedy answer


def test_the_sequence_id_seeds_a_sequence_without_a_seed() -> None:
    m = tiny()
    p = GenParams(max_new_tokens=16, temperature=1.0)
    first = run(m, [(0, PROMPTS[0], 16), (0, PROMPTS[0], 16)], {0: p, 1: p})
    second = run(m, [(0, PROMPTS[0], 16), (0, PROMPTS[0], 16)], {0: p, 1: p})
    assert first == second and first[0] != first[1]


@pytest.mark.parametrize("top_p", [1e-6, 0.0])
def test_a_tiny_top_p_keeps_only_the_most_likely_token(top_p: float) -> None:
    greedy = list(reference(PROMPTS[4], 20))
    got = run(tiny(), [(0, PROMPTS[4], 20)], {0: GenParams(max_new_tokens=20,
                                                           temperature=2.0, top_p=top_p)})[0]
    assert got == greedy


def test_release_frees_the_cache() -> None:
    m = tiny()
    for i, p in enumerate(PROMPTS):
        m.start(i, m.encode(p), GenParams())
    m.step(range(len(PROMPTS)))
    m.step(range(len(PROMPTS)))
    full = m.cache_bytes()
    assert full > 0 and m.active() == len(PROMPTS)
    m.release(1)
    m.release(5)  # the longest: the block is narrower after the rebuild
    m.step([0, 2, 3, 4])
    assert 0 < m.cache_bytes() < full
    for i in (0, 2, 3, 4):
        m.release(i)
    assert m.active() == 0 and m.cache_bytes() == 0
    m.release(4)  # releasing twice is harmless
    m.start(4, m.encode("again"), GenParams())  # the id can be reused
    assert m.step([4]) == list(reference("again", 1))
    m.release(4)
    assert m.cache_bytes() == 0


def test_start_and_step_refuse_bad_calls_with_the_sequence_named() -> None:
    m = tiny()
    with pytest.raises(ValueError, match="sequence 3: empty prompt"):
        m.start(3, [], GenParams())
    with pytest.raises(ValueError, match="sequence 3: prompt of 512 tokens"):
        m.start(3, [1] * 512, GenParams())
    m.start(3, [1, 2], GenParams())
    with pytest.raises(ValueError, match="already started"):
        m.start(3, [1], GenParams())
    with pytest.raises(KeyError, match="sequence 9 is not started"):
        m.step([3, 9])
    with pytest.raises(ValueError, match="appears twice"):
        m.step([3, 3])
    m.release(3)
    assert m.max_context == 512 and m.eos_token_id == 256


def test_causal_lm_loads_a_saved_folder_and_steps_it_the_same(tmp_path: Path) -> None:
    folder = save_tiny_lm(tmp_path / "tiny-lm-folder")
    h = causal_lm(path=str(folder))
    assert isinstance(h, GenerativeHandler) and h.name == "causal-lm" and h.version == "tiny-lm-folder"
    h.setup("cpu")
    m = h.step_model()
    assert m.encode(PROMPTS[4]) == tiny().encode(PROMPTS[4]) and m.decode(m.encode(PROMPTS[4])) == PROMPTS[4]
    plan = [(0, PROMPTS[0], 12), (2, PROMPTS[2], 8)]
    got = run(m, plan)
    assert [tuple(got[0]), tuple(got[1])] == [reference(PROMPTS[0], 12), reference(PROMPTS[2], 8)]


def test_causal_lm_options_are_checked_with_their_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.path: required"):
        CausalLM()
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.path: .* is not a model folder"):
        CausalLM(path=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.dtype: unknown dtype 'fp8'"):
        CausalLM(path=str(tmp_path), dtype="fp8")
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.revision: unknown option"):
        CausalLM(path=str(tmp_path), revision="main")
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.heads: 3 heads"):
        TinyLM(heads=3)
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.kv_heads: 3 must divide"):
        TinyLM(kv_heads=3)
    with pytest.raises(ConfigError, match=r"\$\.model\.options\.layers"):
        TinyLM(layers=0)


def test_tiny_lm_is_the_same_model_every_time() -> None:
    a, b = TinyLM(seed=3), TinyLM(seed=3)
    a.setup("cpu")
    b.setup("cpu")
    ma, mb = a.step_model(), b.step_model()
    assert isinstance(ma, HFStepModel) and isinstance(mb, HFStepModel)
    for (na, pa), (nb, pb) in zip(ma.model.named_parameters(), mb.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(ma.model.lm_head.weight, tiny().model.lm_head.weight)  # another seed


def _random_weights(model: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model.eval()


def _architecture(kind: str) -> Any:
    import transformers as t

    small: dict[str, Any] = {"vocab_size": 259, "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2}
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=259, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                              bos_token_id=256, eos_token_id=256))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**small))
    return t.MistralForCausalLM(t.MistralConfig(**small, sliding_window=None if kind == "mistral" else 8))


@pytest.mark.parametrize("kind", ["gpt2", "qwen2", "mistral"])
def test_other_full_attention_architectures_step_like_generate(kind: str) -> None:
    model = _random_weights(_architecture(kind))
    m = HFStepModel(model, tiny().tokenizer)
    plan = [(0, PROMPTS[0], 12), (0, PROMPTS[1], 6), (2, PROMPTS[2], 9)]
    got = run(m, plan)
    for i, (_, prompt, n) in enumerate(plan):
        ids = torch.tensor([m.encode(prompt)])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=257)[0, ids.shape[1]:].tolist()
        assert got[i] == want, (kind, i)
    assert m.cache_bytes() == 0


def test_a_sliding_window_model_is_refused_with_its_class_named() -> None:
    with pytest.raises(ConfigError, match=r"MistralForCausalLM uses cache layers "
                                          r"\['DynamicSlidingWindowLayer'\]"):
        HFStepModel(_random_weights(_architecture("mistral-window")), tiny().tokenizer)
