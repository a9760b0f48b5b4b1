"""The output side of an outcome: what it owes (``emit``), its result's bytes, its dead letter, settling
the producers that sent it, and exactly-once mode's transactions."""
