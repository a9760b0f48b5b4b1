"""The local broker's start-up helpers (worker/local/kafka_broker.py) that need no broker."""

from __future__ import annotations

import uuid

import pytest

import worker.local.kafka_broker as kb


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """kafka-storage reads "-t -abc..." as an unknown option: 1 start in 64 failed with "argument
    --cluster-id/-t: expected one argument"."""
    dashed = uuid.UUID(bytes=bytes([0xF8]) + bytes(15))  # urlsafe base64 of 0b111110.. starts with "-"
    plain = uuid.UUID(bytes=bytes(16))
    ids = iter([dashed, plain])
    monkeypatch.setattr(kb.uuid, "uuid4", lambda: next(ids))
    cid = kb.new_cluster_id()
    assert cid == "AAAAAAAAAAAAAAAAAAAAAA" and len(cid) == 22


def test_cluster_ids_are_22_url_safe_characters() -> None:
    for _ in range(500):
        cid = kb.new_cluster_id()
        assert len(cid) == 22 and not cid.startswith("-")
        assert set(cid) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
