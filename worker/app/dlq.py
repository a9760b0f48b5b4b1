"""``worker dlq replay``: re-submit dead letters to their source topic once the cause is fixed.

Uses its own consumer group (``<group_id>-dlq-replay``, or ``<group_id>-dlq-replay-<stage>`` with a stage
filter) so each dead letter is replayed once; commits only after the replayed record is delivered. Stops
at the DLQ end offsets taken at start (so records that fail again and come back to the DLQ are not
replayed in a loop). Dead letters with nothing to send back (the worker dropped the original bytes as too big
for its producer, an empty value, a tombstone) are skipped, listed and committed past: replayed, each could
only fail again and come back as a new dead letter.

Why a group per stage filter: a filtered run commits past the dead letters of other stages it leaves
alone. In a shared group a later run for one of those stages would never see them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as KTP

from schemas import DeadLetter, ErrorStage
from worker.app.command_support import unreachable_broker_is_an_error
from worker.config.settings import Config
from worker.kafka.access import check_access
from worker.kafka.clients import make_consumer, producer_config, retry_transient
from worker.timing.clock import LoopClock

CONNECT_TIMEOUT_S = 30.0  # for the broker to answer the first metadata request


def replay_group(cfg: Config, stage: str | None) -> str:
    return f"{cfg.kafka.group_id}-dlq-replay" + (f"-{stage}" if stage else "")


def replay(cfg: Config, limit: int | None = None, stage: str | None = None, dry_run: bool = False,
           timeout_s: float = 30.0, *, new_consumer: Callable[..., Any] = make_consumer,
           new_producer: Callable[[dict[str, Any]], Any] = Producer, clock: LoopClock = time) -> int:
    """Replays the dead letters up to the end offsets taken now; 0 when every one was replayed or skipped.
    ``new_consumer(cfg, **props)``, ``new_producer(conf)`` and ``clock`` are the Kafka clients and the time
    it uses."""
    if stage is not None and stage not in get_args(ErrorStage):
        # No dead letter carries it: every one would be skipped, and committed past.
        raise ValueError(f"unknown error stage {stage!r}; expected one of {', '.join(get_args(ErrorStage))}")
    check_access(cfg)  # a refused login or certificate: exit 2 naming the key, not 30 s of "cannot reach"
    topic = cfg.kafka.dlq_topic
    # A partition the replay group never committed starts at its first dead letter, whatever the config's
    # auto.offset.reset says: with "latest" a first run started at the end, replayed nothing and exited 0.
    consumer = new_consumer(cfg, **{"group.id": replay_group(cfg, stage), "enable.partition.eof": True,
                                     "partition.assignment.strategy": "range",
                                    "auto.offset.reset": "earliest"})
    producer = new_producer(producer_config(cfg))
    with unreachable_broker_is_an_error(cfg.kafka.bootstrap_servers, "$.kafka.bootstrap_servers",
                                        CONNECT_TIMEOUT_S):
        try:
            md = consumer.list_topics(topic, timeout=CONNECT_TIMEOUT_S)
        except KafkaException:
            consumer.close()
            raise
    if topic not in md.topics or md.topics[topic].error is not None:
        print(f"dlq replay: topic {topic!r} does not exist")
        return 1
    parts = list(md.topics[topic].partitions)
    end = {p: retry_transient(consumer.get_watermark_offsets, KTP(topic, p), timeout=30)[1] for p in parts}
    consumer.assign([KTP(topic, p) for p in parts])  # committed offsets of the replay group, else earliest
    done_parts = {p for p in parts if end[p] == 0}
    replayed = skipped = no_bytes = 0
    failures: list[str] = []
    last_activity = clock.monotonic()
    gave_up = False  # replayed records left undelivered: exit without waiting for them

    def cb(err: Any, _m: Any) -> None:
        if err is not None:
            failures.append(str(err))

    try:
        while len(done_parts) < len(parts) and (limit is None or replayed < limit):
            msgs = consumer.consume(500, 0.5)
            to_commit: dict[int, int] = {}
            for m in msgs:
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    print(f"dlq replay: consume error: {err}")  # not progress: the idle timeout keeps running
                    continue
                last_activity = clock.monotonic()
                if err is not None:  # end of partition
                    done_parts.add(m.partition())
                    continue
                if m.offset() >= end[m.partition()]:
                    done_parts.add(m.partition())
                    continue
                if m.offset() + 1 >= end[m.partition()]:
                    done_parts.add(m.partition())
                if limit is not None and replayed >= limit:
                    break
                to_commit[m.partition()] = m.offset() + 1
                seen = examine(m.headers(), m.value(), stage)
                if seen.skip is not None:
                    skipped += 1
                    no_bytes += seen.no_bytes
                    if seen.skip:
                        print(f"  skip {topic}[{m.partition()}]@{m.offset()}{seen.skip}")
                    continue
                dl = seen.letter
                assert dl is not None
                if dry_run:
                    print(f"  would replay {source(dl)} ({_shown(dl.error_stage)}: {_shown(dl.error[:80])})")
                else:
                    producer.produce(dl.source_topic, value=m.value(), key=m.key(),
                                     headers=replay_headers(m.headers()), on_delivery=cb)
                replayed += 1
            if to_commit and not dry_run:
                left = producer.flush(60)
                if failures:
                    print(f"dlq replay: {len(failures)} records failed to deliver: {failures[0]}")
                    gave_up = True
                    return 1
                if left:
                    # Not delivered yet (broker down or slow): committing now would skip dead letters that
                    # were never replayed. The next run starts again from the last commit.
                    print(f"dlq replay: {left} records still undelivered after 60 s; nothing more committed")
                    gave_up = True
                    return 1
                consumer.commit(offsets=[KTP(topic, p, o) for p, o in to_commit.items()], asynchronous=False)
                last_activity = clock.monotonic()  # a slow delivery is progress, not a silent broker
            if len(done_parts) < len(parts) and clock.monotonic() - last_activity > timeout_s:
                # Broker or partition leader gone, or every read failing: not "done", whatever was replayed.
                left = sorted(set(parts) - done_parts)
                print(f"dlq replay: nothing read for {timeout_s:.0f} s with dead letters left on partitions "
                      f"{left}; replayed {replayed} (committed); run it again to go on")
                return 1
    finally:
        if gave_up:
            # Their dead letters are not committed, so the next run replays them: another minute of waiting
            # for the broker here would only hold up the exit (and any that got through would be sent twice).
            producer.purge()
        producer.flush(1 if gave_up else 60)
        consumer.close()
    verb = "would replay" if dry_run else "replayed"
    print(f"dlq replay: {verb} {replayed} dead letters, skipped {skipped}"
          + (f" ({no_bytes} without the original request bytes, listed above)" if no_bytes else ""))
    return 0


# What Kafka takes as a topic name. A dead letter naming anything else could never be delivered: replay would
# fail on it (a NUL raises in produce(), an invalid name fails delivery) at every run, and never get past it.
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_SHOWN_MAX = 200  # characters of a header quoted in a line of output


class Examined(NamedTuple):
    """What replay does with one record of the DLQ topic: ``skip`` None replays ``letter``; otherwise it is
    skipped, with ``skip`` the rest of the line that says why (empty: skipped without a word: another
    stage)."""

    letter: DeadLetter | None
    skip: str | None
    no_bytes: bool = False


def examine(headers: list[tuple[str, bytes | None]] | None, value: bytes | None,
            stage: str | None) -> Examined:
    """Reads a dead letter's headers (written by the worker, or by anyone else who can write to the topic)
    into the decision to replay it or not; never raises. The lines it makes quote header text only through
    _shown."""
    try:
        dl = DeadLetter.from_headers(headers)  # type: ignore[arg-type]
    except ValueError as e:
        return Examined(None, f": {_shown(str(e))}")
    if stage is not None and dl.error_stage != stage:
        return Examined(dl, "")
    if not _TOPIC_NAME.fullmatch(dl.source_topic):
        return Examined(dl, f": x-source-topic {_shown(dl.source_topic)!r} is not a Kafka topic name")
    why = _unreplayable(value, dl)
    if why is not None:
        # Sent back, it could only fail decoding again and come back here as a new dead letter.
        return Examined(dl, f" (from {source(dl)}): {why}", no_bytes=True)
    return Examined(dl, None)


def replay_headers(headers: list[tuple[str, bytes | None]] | None) -> list[tuple[str, bytes | None]]:
    """The record's own headers, without the ones the worker added to the dead letter."""
    return [(k, v) for k, v in (headers or [])
            if not k.startswith(("x-error", "x-source")) and k != "x-attempts"]


def source(dl: DeadLetter) -> str:
    return f"{_shown(dl.source_topic)}[{dl.source_partition}]@{dl.source_offset}"


def _shown(text: str) -> str:
    """Header text fit for a terminal line: control and other unprintable characters escaped (a header could
    otherwise move the cursor or rewrite the lines above), at most _SHOWN_MAX characters."""
    cut = text[:_SHOWN_MAX]
    shown = cut if cut.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return shown + ("..." if len(text) > _SHOWN_MAX else "")


def _unreplayable(value: bytes | None, dl: DeadLetter) -> str | None:
    """Why a dead letter has nothing to send back, or None. The worker writes an empty value where it dropped
    the original bytes (too big for its producer); a tombstone or an empty request is not a request either."""
    if value is None:
        return "nothing to replay: no value (the request was a tombstone)"
    if value:
        return None
    if dl.error.startswith("original value of "):
        return f"nothing to replay: {dl.error.split(': ', 1)[0]}"  # "original value of N bytes dropped (...)"
    return "nothing to replay: empty value"
