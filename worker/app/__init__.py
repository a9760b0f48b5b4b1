"""The command line (``cli``) and its commands: ``worker run`` (``service``, ``supervisor``),
``demo``, ``predict``, ``backfill``, ``dlq``, ``load``, ``profile``, ``check-config``."""
