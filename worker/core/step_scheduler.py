"""Iteration-level scheduling of generative sequences: who joins the next decode step, who leaves after it.

Pure logic: no threads, no clock (time comes in as ``now``), no model (the caller runs the step). One round:

    plan = scheduler.schedule(now)        # expire, admit; plan.admitted need model.start(), plan.ended left
    tokens = model.step(plan.seq_ids)     # one forward over every running sequence
    finished = scheduler.update(tokens, now)

Lifecycle (``SeqState``): WAITING -> RUNNING -> FINISHED | EXPIRED | FAILED, or ABANDONED from either of
the first two (its partition was released). Each submitted sequence reaches exactly one final state, once,
and is handed back exactly once: by ``schedule`` (``plan.ended``), ``update``, ``fail_running`` or ``drop``.

Admission (``admission="reserve"``, the default). A sequence reserves ``len(prompt) + max_new_tokens``
tokens (capped at the model's context) for its whole life, so the tokens in the device's caches never exceed
``max_batch_tokens`` whatever lengths the sequences reach. It is admitted when a slot is free
(``max_sequences``) and its reservation fits in what is left of the budget; a sequence whose reservation alone
exceeds the budget is admitted when nothing else runs (it runs alone). Within a lane admission is FIFO, and a
head that does not fit stops admission for this round: the freed tokens go to it first, so a long request is
not starved by a stream of short ones. With ``admission="grow"`` a sequence counts the tokens its cache holds
after the next step (prompt + generated + 1), as a paged cache allocates them; admission keeps a tenth of the
budget free for growth, and when the next step would still exceed the budget, the latest-admitted sequence of
the lowest-priority running lane is preempted: back to the front of its lane, its tokens dropped and
recomputed when it runs again (the same tokens: its seed and prompt decide them). A head of the
highest-priority lane that does not fit preempts lower-lane sequences the same way, when that makes room for
it. More sequences run at once, at the cost of the recomputed steps.
``headroom`` tokens of the budget are for the highest-priority lane only: the other lanes stop admitting
while their head would cut into it, so an urgent sequence that arrives under overload finds room at once
instead of waiting for running ones to finish (a lower lane gives up that much of the budget).

Choosing the lane: the rule of ``worker.core.scheduler``, per sequence instead of per batch. Each lane keeps
``v = admitted / weight``; among lanes with waiting sequences, those with ``v < v_min + L`` are eligible,
where ``L = max_sequences / min(weight)`` (one full set of slots of lag); the eligible lane with the highest
priority goes first (ties: the lane listed first). A lane that starts waiting begins at
``max(v, v_min of the waiting lanes)``: idle time earns no credit to burst with later.

Finishing (checked after each token, in this order): the EOS token (not kept in the output), a stop string
in the decoded text (the text is cut before it), ``max_new_tokens`` ("length"), the model's context
("context"). A deadline ends a sequence in ``schedule``: waiting or running, it is EXPIRED with the tokens it
has so far.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from worker.core.step_model import GenParams


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    EXPIRED = "expired"
    FAILED = "failed"
    ABANDONED = "abandoned"


FINAL = frozenset({SeqState.FINISHED, SeqState.EXPIRED, SeqState.FAILED, SeqState.ABANDONED})


@dataclass(frozen=True, slots=True)
class LaneRule:
    name: str
    priority: int = 0
    weight: float = 1.0


@dataclass(slots=True, eq=False)
class Seq:
    """One sequence. ``key`` is the caller's handle (the record); ``reason`` is set once it is final:
    eos | stop | length | context | deadline | error | abandoned."""

    id: int
    key: Any
    lane: str
    prompt_ids: list[int]
    params: GenParams
    arrived_at: float
    deadline: float | None
    reserved: int
    state: SeqState = SeqState.WAITING
    tokens: list[int] = field(default_factory=list)
    admitted_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    text: str | None = None  # set when a stop string cut the output; otherwise the caller decodes ``tokens``
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """``admitted``: sequences that join now (the caller starts them in the model before the step);
    ``seq_ids``: every running sequence, in step order; ``ended``: sequences that left in this call
    (expired, or refused at submit), running ones among them to be released from the model."""

    admitted: tuple[Seq, ...]
    seq_ids: tuple[int, ...]
    ended: tuple[Seq, ...]
    preempted: tuple[Seq, ...] = ()  # ("grow" admission) back to waiting: release their caches


class Expired(NamedTuple):
    """A device output for a record whose sequence hit its deadline: an ``expired`` result carrying what it
    generated so far (``output``), not an ``ok`` one."""

    output: Any
    error: str


class _LaneState:
    __slots__ = ("rule", "waiting", "v")

    def __init__(self, rule: LaneRule) -> None:
        self.rule = rule
        self.waiting: deque[Seq] = deque()
        self.v = 0.0


class StepScheduler:
    def __init__(self, lanes: Sequence[LaneRule], *, max_sequences: int, max_batch_tokens: int,
                 max_context: int, eos_token_id: int | None,
                 detokenize: Callable[[Sequence[int]], str], headroom: int = 0,
                 admission: str = "reserve") -> None:
        if not lanes:
            raise ValueError("StepScheduler: at least one lane")
        if max_sequences < 1 or max_batch_tokens < 1 or max_context < 2:
            raise ValueError("StepScheduler: max_sequences, max_batch_tokens >= 1 and max_context >= 2")
        if admission not in ("reserve", "grow"):
            raise ValueError(f"StepScheduler: admission {admission!r}: expected reserve or grow")
        self._grow = admission == "grow"
        # "grow": tokens kept free at admission for the running sequences' next steps.
        self._watermark = max_batch_tokens // 10 if self._grow else 0
        self.preemptions = 0
        self._lanes = {r.name: _LaneState(r) for r in lanes}
        # Priority order once: highest first, ties in config order (sorted is stable).
        self._order = sorted(self._lanes.values(), key=lambda s: -s.rule.priority)
        self._lag = max_sequences / min(r.weight for r in lanes)
        self.max_sequences = max_sequences
        self.max_batch_tokens = max_batch_tokens
        self.headroom = max(0, min(headroom, max_batch_tokens))
        self.max_context = max_context
        self.eos_token_id = eos_token_id
        self._detokenize = detokenize
        self._running: dict[int, Seq] = {}  # admission order = step order
        self._refused: list[Seq] = []
        self._planned: tuple[int, ...] = ()
        self._next_id = 0
        self.reserved_tokens = 0

    # ---- what callers read
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return sum(len(s.waiting) for s in self._lanes.values())

    def __len__(self) -> int:
        """Sequences not final yet (waiting or running)."""
        return self.running + self.waiting

    def lane_of(self, name: str) -> str:
        return name if name in self._lanes else self._order[0].rule.name

    # ---- in
    def submit(self, key: Any, lane: str, prompt_ids: Sequence[int], params: GenParams, now: float,
               deadline: float | None = None) -> Seq:
        """Queues a sequence. One whose prompt leaves no room in the context for a token is FAILED and handed
        back by the next ``schedule``."""
        ids = list(prompt_ids)
        reserve = len(ids) + 1 if self._grow else min(len(ids) + params.max_new_tokens, self.max_context)
        seq = Seq(self._next_id, key, self.lane_of(lane), ids, params, now, deadline, reserve)
        self._next_id += 1
        if not ids or len(ids) >= self.max_context:
            what = "empty" if not ids else f"{len(ids)} tokens, the model's context is {self.max_context}"
            self._end(seq, SeqState.FAILED, "error", now, error=f"inputs.prompt: {what}")
            self._refused.append(seq)
            return seq
        st = self._lanes[seq.lane]
        if not st.waiting:
            backlogged = [s.v for s in self._lanes.values() if s.waiting]
            if backlogged:
                st.v = max(st.v, min(backlogged))
        st.waiting.append(seq)
        return seq

    # ---- one round
    def schedule(self, now: float) -> StepPlan:
        ended = self._refused
        self._refused = []
        ended.extend(self._expire(now))
        preempted = self._preempt() if self._grow else []
        admitted: list[Seq] = []
        while not preempted and len(self._running) < self.max_sequences:
            st = self._pick()
            if st is None:
                break
            head = st.waiting[0]
            room = self.max_batch_tokens - (0 if st is self._order[0] else self.headroom)
            if self._running and self.reserved_tokens + head.reserved + self._watermark > room:
                if self._grow and st is self._order[0]:
                    preempted = self._preempt_for(head, room)
                    if preempted:  # the head goes now; the rest of the round waits (caches being released)
                        self._admit(st, head, now, admitted)
                break  # FIFO: the head gets the next tokens freed
            self._admit(st, head, now, admitted)
        self._planned = tuple(self._running)
        return StepPlan(tuple(admitted), self._planned, tuple(ended), tuple(preempted))

    def update(self, tokens: Sequence[int], now: float) -> list[Seq]:
        """The next token of each sequence of the last plan, in its order. Returns those that finished.
        Sequences dropped since the plan was made are skipped."""
        if len(tokens) != len(self._planned):
            raise ValueError(f"step returned {len(tokens)} tokens for {len(self._planned)} sequences")
        done: list[Seq] = []
        for sid, tok in zip(self._planned, tokens, strict=True):
            seq = self._running.get(sid)
            if seq is None:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            reason = self._after_token(seq, int(tok))
            if reason is not None:
                self._leave(seq)
                self._end(seq, SeqState.FINISHED, reason, now)
                done.append(seq)
            elif self._grow:
                seq.reserved += 1  # the token the next step adds to its cache
                self.reserved_tokens += 1
        self._planned = ()
        return done

    def fail_running(self, error: str, now: float, ids: Sequence[int] | None = None) -> list[Seq]:
        """Running sequences fail with ``error``: those in ``ids``, or all (waiting ones stay). A partial
        failure keeps the plan: ``update`` then skips the failed ones' tokens."""
        failed = [self._running[i] for i in ids if i in self._running] if ids is not None else \
            list(self._running.values())
        for seq in failed:
            self._leave(seq)
            self._end(seq, SeqState.FAILED, "error", now, error=error)
        if ids is None:
            self._planned = ()
        return failed

    def drop(self, pred: Callable[[Seq], bool], now: float) -> list[Seq]:
        """Abandons the sequences, waiting or running, for which ``pred`` holds (their partition was
        released). Returns them; a running one's ``admitted_at`` is set (the caller releases it)."""
        dropped = [s for s in self._running.values() if pred(s)]
        for seq in dropped:
            self._leave(seq)
        for st in self._lanes.values():
            keep: deque[Seq] = deque()
            for seq in st.waiting:
                (dropped if pred(seq) else keep).append(seq)
            st.waiting = keep
        for seq in dropped:
            self._end(seq, SeqState.ABANDONED, "abandoned", now)
        return dropped

    # ---- inside
    def _pick(self) -> _LaneState | None:
        cands = [s for s in self._order if s.waiting]
        if not cands:
            return None
        v_min = min(s.v for s in cands)
        for st in cands:  # priority order
            if st.v < v_min + self._lag:
                return st
        return cands[0]  # unreachable: the lane at v_min is eligible

    def _admit(self, st: _LaneState, head: Seq, now: float, admitted: list[Seq]) -> None:
        st.waiting.popleft()
        st.v += 1.0 / st.rule.weight
        head.state = SeqState.RUNNING
        head.admitted_at = now
        self._running[head.id] = head
        self.reserved_tokens += head.reserved
        admitted.append(head)

    def _preempt_for(self, head: Seq, room: int) -> list[Seq]:
        """"grow": a highest-priority head that does not fit preempts running sequences of lower lanes, the
        latest admitted first, when that makes room for it; otherwise nothing is preempted."""
        top = self._lanes[head.lane].rule.priority
        lower = [x for x in reversed(list(self._running.values())) if self._lanes[x.lane].rule.priority < top]
        need = self.reserved_tokens + head.reserved + self._watermark - room
        victims: list[Seq] = []
        for x in lower:
            if need <= 0:
                break
            victims.append(x)
            need -= x.reserved
        if need > 0:
            return []
        for victim in victims:
            self._requeue(victim)
        return victims

    def _requeue(self, victim: Seq) -> None:
        self._leave(victim)
        victim.state = SeqState.WAITING
        victim.tokens = []
        victim.text = None
        victim.admitted_at = None
        victim.reserved = len(victim.prompt_ids) + 1
        st = self._lanes[victim.lane]
        st.waiting.appendleft(victim)
        st.v -= 1.0 / st.rule.weight
        self.preemptions += 1

    def _preempt(self) -> list[Seq]:
        """"grow": while the next step would take the caches past the budget, the latest-admitted sequence of
        the lowest-priority running lane goes back to the front of its lane, its tokens dropped (recomputed
        when it is admitted again). The last running one is never preempted (it runs alone)."""
        out: list[Seq] = []
        while len(self._running) > 1 and self.reserved_tokens > self.max_batch_tokens:
            victim = min(reversed(list(self._running.values())),
                         key=lambda x: self._lanes[x.lane].rule.priority)
            self._requeue(victim)
            out.append(victim)
        return out

    def _expire(self, now: float) -> list[Seq]:
        out: list[Seq] = []
        for seq in [s for s in self._running.values() if s.deadline is not None and s.deadline <= now]:
            self._leave(seq)
            self._end(seq, SeqState.EXPIRED, "deadline", now)
            out.append(seq)
        for st in self._lanes.values():
            if any(s.deadline is not None and s.deadline <= now for s in st.waiting):
                late = [s for s in st.waiting if s.deadline is not None and s.deadline <= now]
                st.waiting = deque(s for s in st.waiting if s.deadline is None or s.deadline > now)
                for seq in late:
                    self._end(seq, SeqState.EXPIRED, "deadline", now)
                out.extend(late)
        return out

    def _after_token(self, seq: Seq, tok: int) -> str | None:
        if self.eos_token_id is not None and tok == self.eos_token_id:
            return "eos"
        seq.tokens.append(tok)
        stops = seq.params.stop
        if stops:
            text = self._detokenize(seq.tokens)
            cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
            if cuts:
                seq.text = text[:min(cuts)]
                return "stop"
        if len(seq.tokens) >= seq.params.max_new_tokens:
            return "length"
        if len(seq.prompt_ids) + len(seq.tokens) >= self.max_context:
            return "context"
        return None

    def _leave(self, seq: Seq) -> None:
        del self._running[seq.id]
        self.reserved_tokens -= seq.reserved

    @staticmethod
    def _end(seq: Seq, state: SeqState, reason: str, now: float, error: str | None = None) -> None:
        assert seq.state not in FINAL, f"sequence {seq.id} ended twice"
        seq.state = state
        seq.reason = reason
        seq.ended_at = now
        seq.error = error
