"""Redis stopped for 10 s mid-run (ledger and cache on): nothing is lost, results keep coming during the
outage, the run finishes, and the outage is visible: ``kiw_redis_errors_total`` on /metrics and the breaker's
"redis circuit open" warning in the worker log; the circuit closes again once Redis is back."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.chaos.support import (
    OutputWatcher,
    metrics_port,
    report,
    scrape,
    supervise,
    tally,
    wait_committed_to_end,
    where_things_stand,
)
from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    produce_values,
    request,
    wait_for,
    worker_config,
)

pytestmark = pytest.mark.chaos

N = 20_000
OUTAGE_S = 10.0


def redis_errors(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("kiw_redis_errors_total{")}


def test_redis_down_for_10s_mid_run(kafka, local_redis, topic_names, tmp_path):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    reqs = [request(i, inputs=[float(i)]) for i in range(N)]
    produce_values(bs, topic_names["in"], reqs)
    expected = {k.decode() for k, _ in reqs}
    cfg = worker_config(bs, topic_names,
                        model={"name": "synthetic", "options": {"a_ms": 20.0, "b_ms": 0.3}},  # ~1,000/s
                        redis={"url": local_redis.url, "ledger": True, "cache": True,
                               "key_prefix": f"kiw-chaos:{uuid.uuid4().hex[:8]}:",
                               "breaker_failures": 3, "breaker_reset_s": 2.0},
                        metrics={"enabled": True, "host": "127.0.0.1", "port": 0})
    group = cfg["kafka"]["group_id"]
    outage: dict[str, float] = {}
    port: list[int] = []

    def chaos(sup) -> None:  # type: ignore[no-untyped-def]
        if not port:
            port.append(metrics_port(sup.current))
        if "stopped_at" not in outage and watch.seen(expected) >= N // 5:
            outage["before"] = sum(redis_errors(scrape(port[0])).values())
            outage["stopped_at"] = watch.seen(expected)
            local_redis.stop()
            time.sleep(OUTAGE_S)
            outage["during"] = watch.seen(expected) - outage["stopped_at"]
            outage["errors_during"] = sum(redis_errors(scrape(port[0])).values())
            local_redis.start()

    with OutputWatcher(bs, topic_names["out"]) as watch:
        sup = supervise(lambda i: WorkerProcess(cfg, tmp_path, name=f"redis-outage-{i}"),
                        lambda: watch.seen(expected), N, deadline_s=170, restart_exits=False, tick=chaos,
                        diagnose=lambda: where_things_stand(bs, cfg["kafka"]["group_id"], topic_names["in"],
                                                            topic_names["out"], watch))
    last = sup.current
    try:
        assert "stopped_at" in outage, "the outage never happened"
        wait_committed_to_end(bs, group, topic_names["in"], 60)
        # After the outage the breaker's probe succeeds and closes the circuit.
        wait_for(lambda: scrape(port[0]).get("kiw_redis_circuit_open") == 0.0, 30,
                 what="the circuit to close")
        final = scrape(port[0])
        assert last.stop() == 0, last.log()[-3000:]
    finally:
        last.kill()
    log = last.log()

    t = tally(bs, topic_names["out"], topic_names["dlq"], expected, N)
    errs = redis_errors(final)
    report("redis-outage", t, outage_s=OUTAGE_S, results_during_outage=int(outage["during"]),
           redis_errors=int(sum(errs.values())), circuit_open_logs=log.count("redis circuit open"))
    print(
        "redis errors by op: "
        + ", ".join(f"{k[len('kiw_redis_errors_total') :]}={int(v)}" for k, v in errs.items())
    )
    assert len(sup.workers) == 1 and sup.exits == [], "the worker died"
    assert t.lost == 0, f"{t.lost} ids without a result"
    assert t.dlq == 0
    assert all(v["status"] == "ok" for vs in t.by_id.values() for v in vs)
    assert outage["during"] > 0, "no result was produced while Redis was down: the pipeline stalled"
    assert outage["errors_during"] > outage["before"], ("no kiw_redis_errors_total counted during the "
                                                        f"outage: {errs}")
    assert "redis circuit open" in log and "redis circuit closed" in log
