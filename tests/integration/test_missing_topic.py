"""A misnamed output topic on a broker that does not create topics: the worker says so at start, stops with
exit 1 and an error naming ``kafka.output_topic``, and commits nothing it has not delivered."""

from __future__ import annotations

import pytest

from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
    create_topics,
    produce_values,
    request,
    worker_config,
)

pytestmark = pytest.mark.integration


def test_a_missing_output_topic_stops_the_worker_with_a_clear_error(kafka, topic_names, tmp_path):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 1, topic_names["dlq"]: 1})  # no output topic
    produce_values(bs, topic_names["in"], [request(i, prefix="m") for i in range(20)])
    missing = topic_names["out"]
    # The session's broker creates topics on first use; a producer that may not ask for that meets the
    # topic the way a broker with auto.create.topics.enable=false shows it. A short metadata propagation
    # wait (librdkafka default 30 s, per attempt) keeps the test short; the path is the same.
    cfg = worker_config(bs, topic_names, model={"name": "identity", "warmup": False},
                        kafka={"producer": {"allow.auto.create.topics": False,
                                            "topic.metadata.propagation.max.ms": 500}})
    w = WorkerProcess(cfg, tmp_path).start()
    try:
        code = w.wait(timeout=120)
    finally:
        w.kill()
    log = w.log()
    assert code == 1, log[-3000:]
    assert f"kafka.output_topic '{missing}' does not exist on the broker" in log
    assert "does not exist and the broker does not create topics on first use" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert committed_offsets(bs, cfg["kafka"]["group_id"], topic_names["in"]).get(0, 0) <= 0
