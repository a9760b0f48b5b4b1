"""Online batch-latency model: ``latency(n) ~= a + b * n``.

Why: a device pays a fixed cost ``a`` per batch (kernel launches, host<->device copies, Python) and a
marginal cost ``b`` per record. Knowing both lets the adaptive scheduler answer two questions with
arithmetic instead of guesses (see ``scheduler.py``): does waiting for more records pay, and can a
record still meet its deadline if it is dispatched now.

The fit is a weighted least-squares line over ``(n, seconds)`` observations with exponential forgetting
(each new observation multiplies the weight of the older ones by ``decay``), so it follows drift (thermal
throttling, another tenant on the GPU, a model swap) within a few dozen batches. O(1) per observation.

Degenerate data is handled conservatively, i.e. toward predictions that make the scheduler behave like
the fixed policy rather than wait or expire on a hunch:

- all batches the same size (no slope information): ``a = 0``, ``b = mean(seconds) / mean(n)``
  (proportional; it never predicts a fixed cost it has not seen, so it never makes the scheduler wait);
- a negative fitted slope: ``b = 0``, ``a = weighted mean``;
- a negative fitted intercept: ``a = 0`` and a line through the origin.

Nonsense observations (``n < 1``, negative, NaN or infinite seconds) are ignored.
"""

from __future__ import annotations

import math


class LatencyModel:
    __slots__ = ("decay", "min_obs", "observations", "_s0", "_s1", "_s2", "_t0", "_t1", "a", "b")

    def __init__(self, decay: float = 0.98, min_obs: int = 3) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if min_obs < 1:
            raise ValueError(f"min_obs must be >= 1, got {min_obs}")
        self.decay = decay
        self.min_obs = min_obs
        self.observations = 0  # count, not decayed
        self._s0 = self._s1 = self._s2 = self._t0 = self._t1 = 0.0
        self.a = 0.0  # seconds per batch
        self.b = 0.0  # seconds per record

    @property
    def ready(self) -> bool:
        """True once enough batches were observed for predictions to be trusted."""
        return self.observations >= self.min_obs

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        k = self.decay
        x = float(n)
        self._s0 = self._s0 * k + 1.0
        self._s1 = self._s1 * k + x
        self._s2 = self._s2 * k + x * x
        self._t0 = self._t0 * k + seconds
        self._t1 = self._t1 * k + x * seconds
        self.observations += 1
        self._solve()

    def _solve(self) -> None:
        s0, s1, s2, t0, t1 = self._s0, self._s1, self._s2, self._t0, self._t1
        var = s0 * s2 - s1 * s1
        if var <= 1e-9 * s0 * s2:  # every n (nearly) equal: no slope information
            self.a, self.b = 0.0, t0 / s1
            return
        b = (s0 * t1 - s1 * t0) / var
        a = (t0 - b * s1) / s0
        if b < 0.0:
            a, b = t0 / s0, 0.0
        elif a < 0.0:
            a, b = 0.0, t1 / s2
        self.a, self.b = a, b

    def predict(self, n: int) -> float:
        """Predicted seconds for a batch of ``n`` records (0.0 before the first observation)."""
        return self.a + self.b * n

    def __repr__(self) -> str:
        return f"LatencyModel(a={self.a:.6f}, b={self.b:.6f}, observations={self.observations})"


def efficient_size(model: LatencyModel, full: int, efficiency: float) -> int:
    """The smallest batch size ``n <= full`` whose throughput ``n / (a + b*n)`` is at least ``efficiency``
    times a full batch's, ``full / (a + b*full)``; ``full`` when the model has no fixed cost to amortise.

    Throughput rises with ``n`` toward ``1/b`` and flattens once ``b*n`` dominates ``a``: the last records
    of a full batch add little throughput but their whole ``b*n`` to the batch's latency. Solving
    ``n (a + b*full) >= efficiency * full * (a + b*n)`` gives the bound below."""
    a, b = model.a, model.b
    if efficiency >= 1.0 or a <= 0.0 or full <= 1:
        return full
    n = efficiency * full * a / (a + b * full * (1.0 - efficiency))
    return max(1, min(full, math.ceil(n - 1e-9)))
