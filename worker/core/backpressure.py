"""Which partitions the consumer should hold paused: the backpressure decision.

Why: Kafka keeps delivering as fast as the broker serves, while the device drains at its own pace. Reading
must stop before memory does, and resume only once there is room for a useful amount, or the consumer
flaps between paused and resumed at every loop turn. The runner applies the answer with
``consumer.pause``/``resume``; this module only decides.

Four reasons to hold a partition paused, any of which is enough:

- **In-flight bound**: at ``max_in_flight`` records read and not yet done (delivered), every assigned
  partition pauses; they stay paused until in-flight falls to ``bound * resume_ratio`` (hysteresis).
- **A full lane**: a lane whose queue is at its bound pauses the partitions of the topics routed to it,
  so a flood on a low-priority topic cannot crowd out a high-priority one (the scheduler keeps a lane full
  until its queue falls to ``queue_bound * resume_ratio``: ``PriorityScheduler.over_bound``).
- **Backfill**: a partition read up to its end snapshot has nothing more to read.
- **Uncommitted span**: a partition with ``max_uncommitted`` records read since its oldest unfinished one
  (done or not) pauses, until the span falls to ``max_uncommitted * resume_ratio``. The in-flight bound
  counts only unfinished records: behind one that is stuck, finished ones would pile up without limit.

Each reason keeps its own hysteresis: a partition paused for one reason is not held by another's low
watermark (a partition paused for its span, or for a full lane, used to stay paused after its reason
cleared for as long as other lanes kept in-flight above ``bound * resume_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Set
from typing import NamedTuple

from worker.core.records import TopicPartition


class Pauses(NamedTuple):
    want: set[TopicPartition]  # the assigned partitions to hold paused now
    holding: bool  # the in-flight bound holds every partition (pass it back as ``holding`` next time)
    span_held: set[TopicPartition]  # paused for their uncommitted span (pass back as ``span_held``)


def partitions_to_pause(*, in_flight: int, bound: int, resume_ratio: float, assigned: Set[TopicPartition],
                        holding: bool = False, reached: Set[TopicPartition] = frozenset(),
                        full_lanes: Collection[str] = (),
                        lane_of: Callable[[TopicPartition], str] | None = None,
                        spans: Mapping[TopicPartition, int] | None = None,
                        span_bound: int = 0, span_held: Set[TopicPartition] = frozenset()) -> Pauses:
    """``holding`` and ``span_held`` are what the previous decision returned (the hysteresis of each reason);
    ``reached``, the backfill partitions read to their end; ``full_lanes``, the lanes at their queue bound,
    and
    ``lane_of`` the lane a partition's topic is routed to; ``spans``, each partition's uncommitted span
    (partitions left out count as 0), paused from ``span_bound`` on."""
    hold = in_flight >= bound or (holding and in_flight > bound * resume_ratio)
    want = set(assigned) if hold else set()
    want |= reached & assigned
    by_span: set[TopicPartition] = set()
    if spans and span_bound > 0:
        by_span = {tp for tp, n in spans.items() if tp in assigned
                   and (n >= span_bound or (tp in span_held and n > span_bound * resume_ratio))}
        want |= by_span
    if full_lanes and lane_of is not None:
        want |= {tp for tp in assigned if lane_of(tp) in full_lanes}
    return Pauses(want, hold, by_span)
