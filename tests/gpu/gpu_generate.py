"""The CUDA path of the generative models: HFStepModel on the device, in fp16 and bf16. Prints a table.

    python tests/gpu/gpu_generate.py            # on a CUDA machine
    python tests/gpu/gpu_generate.py --cpu      # smoke run anywhere (fp32, small shapes, a few steps, one
                                                # torch thread, 8 requests through two of the engines)

Checks:
  greedy_match   continuous stepping (sequences joining at different steps) gives the tokens that
                 ``generate(do_sample=False)`` gives each prompt alone on the same device and dtype:
                 PASS/FAIL in fp32; INFO in fp16/bf16, where padded and unpadded attention round differently
  step_tokens_s  decode tokens/s of one ``step`` over 1, 16 and 64 active sequences (prompts of 128 tokens),
                 per dtype, on ``tiny`` (tiny-lm: 2 layers, hidden 64) and ``realistic`` (a Llama-1B shape:
                 16 layers, hidden 2048, 32 heads, 8 KV heads, vocab 32000; random weights, no download)
                 (info)
  engines        tests/bench/gen_engines on the device: tokens/s and mean latency of each engine (info)
Exit code 0 when every PASS/FAIL check passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from worker.core.step_model import GenParams  # noqa: E402
from worker.models.causal_lm import HFStepModel  # noqa: E402
from worker.models.tiny_lm import build_tiny_lm, build_tokenizer, tiny_options  # noqa: E402

Result = dict[str, Any]  # name, value, target, status (PASS|FAIL|INFO|SKIP), detail
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 259},
    "realistic": {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 8192,
                  "vocab": 32000},
    "smoke": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 1000},
}


def shaped_model(shape: str, device: str, dtype: torch.dtype) -> HFStepModel:
    """A Llama of the given shape with random weights (scaled 1/sqrt(fan_in)), on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], max_position_embeddings=4096, eos_token_id=None)
    with torch.device(device):
        model: Any = LlamaForCausalLM(cfg)
    model.to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=dtype) * p.shape[-1] ** -0.5)
    model.eval()
    return HFStepModel(model, build_tokenizer())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_greedy_match(device: str, dtype: str, quick: bool) -> list[Result]:
    opts = tiny_options()
    model, tokenizer = build_tiny_lm(opts)
    model.to(device=device, dtype=DTYPES[dtype])
    m = HFStepModel(model, tokenizer)
    prompts = ["hello world", "a", "the quick brown fox", "0123456789" * 4, "ünïcødé", "zz top"]
    plan = [(j % 4, p, 8 + 5 * j if quick else 16 + 11 * j) for j, p in enumerate(prompts)]
    got: dict[int, list[int]] = {i: [] for i in range(len(plan))}
    active: list[int] = []
    step = 0
    while step <= 3 or active:
        for i, (join, prompt, n) in enumerate(plan):
            if join == step:
                m.start(i, m.encode(prompt), GenParams(max_new_tokens=n))
                active.append(i)
        for i, t in zip(list(active), m.step(active), strict=True):
            got[i].append(t)
            if t == m.eos_token_id or len(got[i]) >= plan[i][2]:
                active.remove(i)
                m.release(i)
        step += 1
    agree = 0
    for i, (_, prompt, n) in enumerate(plan):
        ids = torch.tensor([m.encode(prompt)], device=device)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        agree += ref[0, ids.shape[1]:].tolist() == got[i]
    frac = agree / len(plan)
    exact = dtype == "fp32"
    status = ("PASS" if frac == 1.0 else "FAIL") if exact else "INFO"
    return [{"name": f"greedy_match {dtype}", "value": round(frac, 3), "target": "1.0" if exact else "info",
             "status": status, "detail": f"{agree}/{len(plan)} sequences equal to generate(); cache bytes "
                                         f"left {m.cache_bytes()}"}]


def check_step_tokens(device: str, dtype: str, shape: str, quick: bool) -> list[Result]:
    m = shaped_model(shape, device, DTYPES[dtype])
    vocab = SHAPES[shape]["vocab"]
    prompt_len, steps = (16, 4) if quick else (128, 32)
    out = []
    for active in (1, 16, 64) if not quick else (1, 8):
        g = torch.Generator().manual_seed(active)
        ids = list(range(active))
        for i in ids:
            m.start(i, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), GenParams())
        m.step(ids)  # prefill
        m.step(ids)  # the first decode joins nothing new: its block is reused from here on
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            m.step(ids)
        _sync(device)
        dt = time.perf_counter() - t0
        for i in ids:
            m.release(i)
        out.append({"name": f"step_tokens_s {shape} {dtype} x{active}",
                    "value": round(active * steps / dt, 1),
                    "target": "info", "status": "INFO",
                    "detail": f"{dt / steps * 1e3:.2f} ms per step, context {prompt_len}+{steps}"})
    return out


def check_engines(device: str, quick: bool) -> list[Result]:
    from tests.bench import gen_engines

    only = ("hf-static-16", "step-model-16") if quick else ()
    rows = gen_engines.measure(device, 8 if quick else 64, 1, only)
    return [{"name": f"engines {r['engine']}", "value": round(r["tokens_per_s"], 1), "target": "info",
             "status": "INFO", "detail": f"mean latency {r['mean_latency_s']:.3f} s, agree {r['agree']}/"
                                         f"{r['requests']}"} for r in rows]


def run_all(device: str, quick: bool) -> list[Result]:
    dtypes = ["fp32"] if device == "cpu" else ["fp32", "fp16", "bf16"]
    shapes = ["smoke"] if device == "cpu" else ["tiny", "realistic"]
    jobs: list[tuple[str, Any]] = [(f"greedy_match {d}", lambda d=d: check_greedy_match(device, d, quick))
                                   for d in dtypes]
    jobs += [(f"step_tokens_s {s} {d}", lambda s=s, d=d: check_step_tokens(device, d, s, quick))
             for s in shapes for d in dtypes if not (s == "realistic" and d == "fp32")]
    jobs.append(("engines", lambda: check_engines(device, quick)))
    results: list[Result] = []
    for name, job in jobs:
        try:
            results.extend(job())
        except Exception as e:  # one failing check must not hide the others
            traceback.print_exc()
            results.append({"name": name, "value": None, "target": "", "status": "FAIL", "detail": repr(e)})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="smoke run on the CPU: fp32, small shapes, few steps")
    ap.add_argument("--device", default="cuda", help="the device when not --cpu (default cuda)")
    a = ap.parse_args(argv)
    device = "cpu" if a.cpu else a.device
    if a.cpu:
        # small shapes gain nothing from more, and a shared machine slows spinning threads
        torch.set_num_threads(1)
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the smoke run", file=sys.stderr)
        return 2
    results = run_all(device, quick=a.cpu)
    print(f"{'check':<36} {'value':>10} {'target':>7} status detail")
    for r in results:
        print(f"{r['name']:<36} {r['value']!s:>10} {r['target']:>7} {r['status']:<6} {r['detail']}")
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
