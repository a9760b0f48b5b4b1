"""The loop's clock (``LoopClock``) and ``Deadline``, a point on it that several waits share."""
