"""The pipeline benchmark's peers (``tests.bench.pipeline.PEERS``) on a real broker: each one, started with
the very command line the benchmark gives it, turns a few hundred requests into one result each (the
request's key, its id, its source partition and offset) and commits its group's offsets to the end of the
input, so that the benchmark compares systems that all do the whole job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.common import Proc, produce_backlog
from tests.bench.pipeline import PARTITIONS, PEERS, peer_argv, requests
from tests.support.kafka_io import (
    committed_offsets,
    create_topics,
    decode,
    end_offsets,
    read_all,
    wait_for,
)

pytestmark = pytest.mark.integration

N = 300


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_a_benchmark_peer_delivers_every_result_and_commits_to_the_end(kafka, topic_names, tmp_path: Path,
                                                                       peer: str) -> None:
    bs, inp, out = kafka.bootstrap, topic_names["in"], topic_names["out"]
    group = f"{peer}-{topic_names['run']}"
    create_topics(bs, {inp: PARTITIONS, out: PARTITIONS})
    sent = list(requests(N))
    produce_backlog(bs, inp, sent, PARTITIONS)
    ends = end_offsets(bs, inp)
    assert sum(ends.values()) == N

    proc = Proc(peer, peer_argv(peer, bs, inp, out, group, tmp_path), tmp_path)
    try:
        proc.wait_for_log(PEERS[peer][1], timeout=120)
        msgs = read_all(bs, out, want=N, timeout=120)
        # Offsets are committed once a second or so while the peer runs; all of them before it is stopped.
        wait_for(lambda: committed_offsets(bs, group, inp) == ends, timeout=60,
                 what=f"{group} commits to the end")
    finally:
        code = proc.stop()
    log = proc.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]

    assert len(msgs) == N, f"{len(msgs)} results for {N} requests"
    by_id = {r["id"]: (m, r) for m, r in zip(msgs, decode(msgs), strict=True)}
    assert sorted(by_id) == sorted(k.decode() for k, _ in sent)
    # The backlog went to the partitions round-robin: request i is the (i // P)-th record of partition i % P.
    for i in range(N):
        m, r = by_id[f"p-{i}"]
        assert m.key() == f"p-{i}".encode()
        assert r["status"] == "ok" and r["model"] == "identity" and r["outputs"]["v"] == i
        assert r["source"] == {"topic": inp, "partition": i % PARTITIONS, "offset": i // PARTITIONS}
    assert committed_offsets(bs, group, inp) == ends
