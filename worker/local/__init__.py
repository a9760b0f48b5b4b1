"""Launchers for a local Apache Kafka broker and Redis server (tests, ``worker demo``)."""
