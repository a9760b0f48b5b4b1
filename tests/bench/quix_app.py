"""Baseline: a Quix Streams application doing the same job: consume -> apply (build the result) -> produce.

The idiomatic Quix Streams 3 pipeline: ``app.dataframe(input)`` (JSON values) ``.apply(fn)``
``.to_topic(output)``, at-least-once, ``commit_interval=1.0`` s (the worker's ``commit_interval_ms`` default).
librdkafka gets the
worker's fetch and produce settings (``worker.kafka.clients`` defaults: prefetch queue, fetch wait
and backoff; linger, batch size, lz4, acks=all; Quix already sets an idempotent producer), so that the
comparison is of the frameworks, not of their defaults. Quix keeps what it requires: its own commit handling,
per-message delivery reports and the range assignor. Per record it builds the same result as the raw loop (id,
status, outputs, model, source).

``python -m tests.bench.quix_app --bootstrap B --input T --output T --group G --state-dir D``; SIGTERM stops
it (Quix handles the signal: it finishes the current message and commits).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--state-dir", required=True)
    args = ap.parse_args()

    from quixstreams import Application, message_context

    from worker.kafka.clients import CONSUMER_DEFAULTS, PRODUCER_DEFAULTS

    consumer_extra = {k: CONSUMER_DEFAULTS[k] for k in ("queued.max.messages.kbytes", "queued.min.messages",
                                                        "fetch.wait.max.ms", "fetch.queue.backoff.ms")}
    producer_extra = {k: PRODUCER_DEFAULTS[k] for k in ("acks", "linger.ms", "batch.num.messages",
                                                        "compression.type")}
    app = Application(broker_address=args.bootstrap, consumer_group=args.group, auto_offset_reset="earliest",
                      commit_interval=1.0, state_dir=args.state_dir, loglevel="WARNING",
                      auto_create_topics=False, use_changelog_topics=False,
                      consumer_extra_config=consumer_extra, producer_extra_config=producer_extra)
    inp = app.topic(args.input, value_deserializer="json")
    out = app.topic(args.output, value_serializer="json")

    def result(req: dict[str, Any]) -> dict[str, Any]:
        ctx = message_context()
        return {"id": req["id"], "status": "ok", "outputs": req.get("inputs"), "model": "identity",
                "source": {"topic": ctx.topic, "partition": ctx.partition, "offset": ctx.offset}}

    sdf = app.dataframe(inp)
    sdf = sdf.apply(result)
    sdf.to_topic(out)
    logging.getLogger("bench").warning("quix app started")
    print("quix app started", flush=True)
    app.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
