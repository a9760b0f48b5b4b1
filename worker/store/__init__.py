"""The optional store (Redis, or in memory): result cache, delivered-id ledger, attempt counters."""
