"""Issue 27 - feed the GPU: what the host path alone delivers, against what tokenizing alone allows.

The ``minilm`` handler with a forward that costs nothing (``tests.bench.null_device:null_minilm``: decode,
collate and split are the real handler's) runs end to end through Kafka on the texts ``worker load
--model-input minilm`` sends, at max batch 256. The baseline, in the same run: the same texts through the
handler's tokenizer alone, ``encode_batch`` in batches of 256 on every core (a separate process, best of 2
passes before and after the worker runs, as the machine is shared). Figure: results/s over the 5-95% window
of the output's append times. Target: worker / tokenizer ceiling >= 0.8.

Also printed: the worker's CPU per record by thread, from ``/proc/<pid>/task/*/stat`` between assignment
and the last result. The worker names its threads (``kiw-collate``, ``kiw-device``, ``kiw-finish``,
``kiw-host``); ``rdk:*`` are librdkafka's; "other" holds the rest (the tokenizer's Rust thread pool, torch).

Info rows (``INFO_VARIANTS``): the same worker with the handler's tokenizing on the loop thread, one text at a
time (``decode``, no ``decode_batch``: ``loop_decode_minilm`` below), what the host threads gain; and with
``model.host_threads: 1`` (one host thread, the tokenizer's Rust pool of one).

Extending: ``VARIANTS`` lists (label, config sections merged into the worker's config); each becomes a row
against the same ceiling, e.g. ``("binary outputs", {"delivery": {"outputs_encoding": "float32"}})``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from tests.bench.common import (
    Ctx,
    Proc,
    create_topics,
    log,
    produce_backlog,
    read_topic,
    row,
    start_worker,
    wait_assigned,
    wait_count,
    window_rate,
    worker_config,
)
from tests.bench.null_device import NullDeviceMiniLM

PARTITIONS = 4
BATCH = 256
NULL_MODEL = "tests.bench.null_device:null_minilm"
LOOP_DECODE_MODEL = "tests.bench.gpu_feed:loop_decode_minilm"
SCENARIO = "27 gpu feed (null-device minilm)"
# (label, config sections merged into the worker's); every variant runs against the same ceiling.
VARIANTS: list[tuple[str, dict[str, Any]]] = [("1 process, JSON outputs", {})]
# Info rows, against the same ceiling: what the host threads gain, and the knob at its smallest.
INFO_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("tokenizing on the loop thread", {"model": {"name": LOOP_DECODE_MODEL}}),
    ("model.host_threads: 1", {"model": {"host_threads": 1}}),
]


class LoopDecodeMiniLM(NullDeviceMiniLM):
    """The null-device handler without ``decode_batch``: each text is tokenized on the loop thread."""

    decode_batch = None  # type: ignore[assignment]


def loop_decode_minilm(**options: Any) -> LoopDecodeMiniLM:
    return LoopDecodeMiniLM(**options)


def corpus(n: int, seed: int = 27) -> list[str]:
    """The texts ``worker load --model-input minilm`` sends."""
    from worker.load import make_inputs

    gen = make_inputs("minilm", random.Random(seed))
    return [gen(i)["text"] for i in range(n)]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread class of process ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        cls = thread_class(int(task.name), pid, comm)
        out[cls] = out.get(cls, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_class(tid: int, pid: int, comm: str) -> str:
    if tid == pid:
        return "loop"
    for prefix, cls in (("kiw-collate", "collate"), ("kiw-device", "device"), ("kiw-finish", "finish"),
                        ("kiw-host", "host pool"), ("rdk:", "kafka client")):
        if comm.startswith(prefix):
            return cls
    return "other"


def per_record_us(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    keys = sorted(set(before) | set(after))
    out = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / max(n, 1) * 1e6 for k in keys}
    out["total"] = sum(out.values())
    return out


def run_worker(ctx: Ctx, texts: list[str], tag: str, sections: dict[str, Any]) -> dict[str, Any]:
    """One worker over ``texts``: results/s and CPU per record by thread. ``sections``: config sections merged
    into the scenario's (``{"model": {"host_threads": 1}}``)."""
    r = f"{ctx.run}-{tag}"
    inp, out, dlq = f"feed-in-{r}", f"feed-out-{r}", f"feed-dlq-{r}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS, out: PARTITIONS, dlq: 1}, log_append_time=[out])
    cfg = worker_config(ctx.bootstrap, f"feed-{r}", out, dlq, topics=[inp],
                        lanes=[{"name": "default", "max_batch_size": BATCH, "max_wait_ms": 10}],
                        model={"name": NULL_MODEL, "warmup": True},
                        batching={"max_in_flight": 8 * BATCH})
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    w = start_worker(f"feed-worker-{tag}", cfg, ctx.work)
    enc = msgspec.json.Encoder()
    try:
        wait_assigned(w, timeout=300)
        before = thread_cpu(w.pid)
        reqs = ((f"f-{i}".encode(), enc.encode({"id": f"f-{i}", "inputs": {"text": t}}))
                for i, t in enumerate(texts))
        produce_backlog(ctx.bootstrap, inp, reqs, PARTITIONS)
        got = wait_count(ctx.bootstrap, out, len(texts), timeout=900, alive=w.alive)
        after = thread_cpu(w.pid)
    finally:
        w.stop()
    rows = read_topic(ctx.bootstrap, out, want=got)
    rate = window_rate([ts for ts, _ in rows])
    cpu = per_record_us(before, after, got)
    log(f"  worker {tag}: {got}/{len(texts)} results, {rate:,.0f}/s; CPU us/record: "
        + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
    return {"results": got, "throughput_per_s": rate, "cpu_us_per_record": cpu}


def ceiling(ctx: Ctx, path: Path, tag: str) -> dict[str, float]:
    p = Proc(f"feed-ceiling-{tag}", [sys.executable, "-m", "tests.bench.gpu_feed", "--ceiling", str(path),
                                     "--batch", str(BATCH)], ctx.work)
    if p.proc.wait(900) != 0:
        raise RuntimeError(f"tokenizer ceiling failed: {p.log()[-2000:]}")
    res: dict[str, float] = json.loads(p.log().strip().splitlines()[-1])
    log(f"  tokenizer alone ({tag}): encode_batch {res['batch_rate']:,.0f}/s, one by one "
        f"{res['single_rate']:,.0f}/s, {res['threads']} CPUs")
    return res


def _cpu_note(cpu: dict[str, float]) -> str:
    return "CPU us/record: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())


def run(ctx: Ctx, variants: list[tuple[str, dict[str, Any]]] | None = None) -> dict[str, Any]:
    n = 4000 if ctx.quick else 20000
    texts = corpus(n)
    path = ctx.work / "feed-texts.json"
    path.write_text(json.dumps(texts))
    log(f"gpu feed: null-device minilm on {n} texts, max batch {BATCH}")
    first = ceiling(ctx, path, "before")
    runs = {label: run_worker(ctx, texts, f"v{i}", sections)
            for i, (label, sections) in enumerate(variants or VARIANTS)}
    info = {label: run_worker(ctx, texts, f"i{i}", sections)
            for i, (label, sections) in enumerate(INFO_VARIANTS)}
    second = ceiling(ctx, path, "after")
    base = max(first["batch_rate"], second["batch_rate"])
    single = max(first["single_rate"], second["single_rate"])
    against = f"tokenizer encode_batch alone, {first['threads']:.0f} CPUs"
    rows = [row(SCENARIO, f"worker texts/s, {label}", res["throughput_per_s"], against, base, ">=", 0.8,
                "texts/s", _cpu_note(res["cpu_us_per_record"])) for label, res in runs.items()]
    rows += [row(SCENARIO, f"worker texts/s, {label}", res["throughput_per_s"], against, base, "info", 0,
                 "texts/s", _cpu_note(res["cpu_us_per_record"])) for label, res in info.items()]
    rows.append(row(SCENARIO, "tokenizer one text at a time", single, "tokenizer encode_batch alone", base,
                    "info", 0, "texts/s", "what batching the tokenizer gains"))
    main = next(iter(runs.values()))
    return {"texts": n, "batch": BATCH, "ceiling": {"before": first, "after": second, "best": base},
            "workers": runs, "info_workers": info, "cpu_us_per_record": main["cpu_us_per_record"],
            "rows": rows}


def measure_ceiling(texts: list[str], batch: int, passes: int = 2) -> dict[str, float]:
    """Texts/s through the minilm tokenizer alone: ``encode_batch`` by ``batch`` and one text at a time."""
    from worker.adapters.torch_device import available_cpus
    from worker.models.minilm import MiniLMModel

    tok = MiniLMModel().tokenizer
    tok.encode_batch(texts[:batch])  # the Rust thread pool starts here, not in the timed pass
    best = single = 0.0
    for _ in range(passes):
        t = time.perf_counter()
        for i in range(0, len(texts), batch):
            tok.encode_batch(texts[i : i + batch])
        best = max(best, len(texts) / (time.perf_counter() - t))
        part = texts[: max(1, len(texts) // 4)]
        t = time.perf_counter()
        for s in part:
            tok.encode(s)
        single = max(single, len(part) / (time.perf_counter() - t))
    return {"batch_rate": best, "single_rate": single, "threads": float(available_cpus())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The gpu_feed scenario's tokenizer ceiling (run by run_all).")
    ap.add_argument("--ceiling", type=Path, required=True, help="a JSON list of texts")
    ap.add_argument("--batch", type=int, default=BATCH, help="texts per encode_batch call")
    args = ap.parse_args(argv)
    print(json.dumps(measure_ceiling(json.loads(args.ceiling.read_text()), args.batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
