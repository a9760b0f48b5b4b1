"""Exactly-once mode on the real broker, and ``worker dlq replay``."""

from __future__ import annotations

import collections
import subprocess
import sys

import msgspec
import pytest
import yaml

from tests.support.kafka_io import (
    ROOT,
    WorkerProcess,
    decode,
    end_offsets,
    once_each_in_source_order,
    read_all,
)

pytestmark = pytest.mark.integration
enc = msgspec.json.encode


def test_exactly_once_results_visible_once_under_read_committed(scenario, topic_names):
    n = 4000
    scenario.topics(4)
    items = [(f"e-{i}".encode(), enc({"id": f"e-{i}", "inputs": {"x": i}})) for i in range(n)]
    items.insert(n // 2, (b"bad", b"{broken"))
    scenario.produce(items)
    cfg = scenario.config(model={"name": "synthetic", "options": {"a_ms": 1, "b_ms": 0.02}},
                          delivery={"mode": "exactly_once", "transactional_id": f"tx-{topic_names['run']}"})
    results, w = scenario.serve(cfg, want=n, timeout=180)
    once_each_in_source_order(results, {f"e-{i}" for i in range(n)})
    # No transaction aborted here, so a read_uncommitted reader sees the same n results, and the dead letter
    # went through the same transactions.
    assert len(scenario.read_out(want=n, timeout=60, read_committed=False)) == n
    dlq = scenario.read_dlq(want=1, timeout=30)
    assert len(dlq) == 1 and dlq[0].value() == b"{broken"
    assert "exactly-once mode" in w.log()
    print(f"\n[eos] {n} ids exactly once under read_committed, 1 dead letter")


def test_dlq_replay_resubmits_to_the_source_topic(scenario, topic_names, tmp_path):
    bs = scenario.bootstrap
    scenario.topics(2)
    # A model that fails on "poison" puts two records in the DLQ (stage "inference").
    good = [(f"g-{i}".encode(), enc({"id": f"g-{i}", "inputs": {"x": i}})) for i in range(50)]
    bad = [(f"p-{i}".encode(), enc({"id": f"p-{i}", "inputs": {"x": "poison"}})) for i in range(2)]
    scenario.produce(good + bad + [(b"junk", b"not json")])
    cfg = scenario.config(model={"name": "synthetic", "options": {"fail_on": "poison"}})
    with scenario.worker(cfg):
        scenario.read_out(want=52, timeout=120)
        scenario.read_dlq(want=3, timeout=30)
    dlq = scenario.read_dlq(want=3, timeout=30)
    stages = sorted(dict(m.headers())["x-error-stage"].decode() for m in dlq)
    assert stages == ["decode", "inference", "inference"]
    before = sum(end_offsets(bs, topic_names["in"]).values())

    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    dry = subprocess.run([sys.executable, "-m", "worker", "dlq", "replay", "--config", str(path), "--dry-run",
                          "--filter-stage", "inference"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "would replay 2 dead letters" in dry.stdout
    assert sum(end_offsets(bs, topic_names["in"]).values()) == before

    run = subprocess.run([sys.executable, "-m", "worker", "dlq", "replay", "--config", str(path),
                          "--filter-stage", "inference"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "replayed 2 dead letters, skipped 1" in run.stdout
    assert sum(end_offsets(bs, topic_names["in"]).values()) == before + 2
    everything = read_all(bs, topic_names["in"], timeout=20, idle=2)
    keys = collections.Counter(m.key() for m in everything)
    assert keys[b"p-0"] == 2 and keys[b"p-1"] == 2 and keys[b"junk"] == 1  # originals + the replays
    assert all(not k.startswith("x-") for m in everything for k, _ in (m.headers() or []))
    # Replaying the same stage again finds nothing new: its replay group committed its progress.
    again = subprocess.run([sys.executable, "-m", "worker", "dlq", "replay", "--config", str(path),
                            "--filter-stage", "inference"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert again.returncode == 0 and "replayed 0 dead letters" in again.stdout, again.stdout + again.stderr
    # The filtered run's progress is its own: an unfiltered replay still sees every dead letter, the decode
    # one it skipped included (in a shared group that one would have been committed past, never replayed).
    rest = subprocess.run([sys.executable, "-m", "worker", "dlq", "replay", "--config",
                           str(path), "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert rest.returncode == 0 and "would replay 3 dead letters" in rest.stdout, rest.stdout + rest.stderr


def test_a_live_zombie_is_fenced_and_readers_still_see_each_id_once(scenario, topic_names, tmp_path):
    """Two live workers with one transactional.id (a replacement pod started while the old one still runs):
    the newcomer's producer fences the old one, which stops with exit 1 at its next transactional call, and
    a read_committed reader still sees every id exactly once."""
    n = 8000
    scenario.topics(2)
    scenario.produce([(f"z-{i}".encode(), enc({"id": f"z-{i}", "inputs": {"x": i}})) for i in range(n)])
    # ~600/s
    cfg = scenario.config(model={"name": "synthetic", "options": {"a_ms": 20, "b_ms": 1}},
                          delivery={"mode": "exactly_once",
                                    "transactional_id": f"tx-zombie-{topic_names['run']}"})
    old = WorkerProcess(cfg, tmp_path, name="old").start()
    try:
        scenario.read_out(want=500, timeout=120)  # the old one is well into the run
        with scenario.worker(cfg, name="new"):
            assert old.wait(120) == 1, old.log()[-3000:]  # fenced: exits on its own
            assert "fenced" in old.log().lower()
            results = scenario.delivered(cfg["kafka"]["group_id"], want=n, timeout=180, commit_timeout=60)
    finally:
        old.kill()
    ids = collections.Counter(r["id"] for r in decode(results))
    assert set(ids) == {f"z-{i}" for i in range(n)} and max(ids.values()) == 1
    print(f"\n[eos-zombie] old worker fenced (exit 1); {len(ids)} ids exactly once under read_committed")
