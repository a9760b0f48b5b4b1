"""Fixtures of the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.kafka_io import Scenario


@pytest.fixture
def scenario(kafka, topic_names: dict[str, str], tmp_path: Path) -> Scenario:
    """This test's topics and worker files on the session's broker."""
    return Scenario(kafka.bootstrap, topic_names, tmp_path)
