"""kafka-inference-worker: Kafka -> micro-batches -> PyTorch -> Kafka, committing only what was delivered."""

__version__ = "0.1.0"
