"""One model on one device: the torch engine, its three threads, host decode, pinned buffers, and recovery
from out-of-memory errors and bad batches."""
