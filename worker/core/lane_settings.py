"""What the scheduler needs to know of a lane, in core's own terms.

``LaneSpec`` is the shape the scheduler reads (``worker.config.settings.LaneConfig`` has it, and
``LaneConfig.settings()`` converts one); ``LaneSettings`` is the frozen copy the scheduler keeps, checked
once (the lane's batcher checks the sizes), so a config object changed later changes nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LaneSpec(Protocol):
    """A lane as the config describes it (the fields ``LaneSettings.of`` reads)."""

    @property
    def name(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def weight(self) -> float: ...

    @property
    def max_batch_size(self) -> int: ...

    @property
    def max_wait_ms(self) -> float: ...

    @property
    def queue_bound(self) -> int: ...

    @property
    def fill_with_lower(self) -> bool: ...

    @property
    def fill_efficiency(self) -> float: ...

    @property
    def max_batch_tokens(self) -> int | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneSettings:
    """One lane: ``priority`` (higher first), ``weight`` (share under overload), ``max_batch_size``,
    ``max_wait_ms`` (how long a window stays open), ``queue_bound`` (records queued before its partitions
    pause), ``fill_with_lower`` (a partial batch takes lower lanes' records), ``fill_efficiency`` (how far
    such a batch grows: see ``worker.core.latency.efficient_size``), ``max_batch_tokens`` (the most a batch
    may cost, in record sizes; None: no budget)."""

    name: str
    priority: int = 0
    weight: float = 1.0
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    queue_bound: int = 10_000
    fill_with_lower: bool = False
    fill_efficiency: float = 1.0
    max_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"lane {self.name!r}: weight must be > 0, got {self.weight}")
        if not 0 < self.fill_efficiency <= 1:
            raise ValueError(f"lane {self.name!r}: fill_efficiency must be in (0, 1], "
                             f"got {self.fill_efficiency}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"lane {self.name!r}: max_batch_tokens must be >= 1 (or null: no budget), "
                             f"got {self.max_batch_tokens}")

    @classmethod
    def of(cls, spec: LaneSpec) -> LaneSettings:
        if isinstance(spec, LaneSettings):
            return spec
        return cls(name=spec.name, priority=spec.priority, weight=float(spec.weight),
                   max_batch_size=spec.max_batch_size, max_wait_ms=spec.max_wait_ms,
                   queue_bound=spec.queue_bound, fill_with_lower=spec.fill_with_lower,
                   fill_efficiency=spec.fill_efficiency, max_batch_tokens=spec.max_batch_tokens)
