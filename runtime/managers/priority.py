"""Priority scheduling: a request's rank, and preemption of running requests for it.

Under --schedule-policy priority the waiting queue is ordered by rank, then arrival
(SchedulePolicy), and a decode round short of KV retracts the lowest ranks first
(ScheduleBatch.retract_decode). `rank` folds --schedule-low-priority-values-first in:
everywhere here a larger rank is more important. A request without a priority has 0.

Preemption (--enable-priority-preemption). Invariants:
- Only a waiting request that PrefillAdder refuses for lack of KV (NO_TOKEN) or of a
  running slot, not for this round's prefill budgets, preempts, and only running requests it outranks by more than
  --priority-scheduling-preemption-threshold (at 0: strictly lower priorities), lowest
  rank first, latest arrival first among equals. Never the chunked request (it is not in
  the running batch), a request being aborted, or one already finished.
- Nothing is retracted unless retracting every such victim could make room (an upper
  bound: a victim frees at most the KV it holds plus its reserved decode tokens); then
  victims go one at a time until the request fits, so no more than needed. (The bound is
  optimistic where victims share a prefix that other requests hold: then all of them may
  go and the request still waits, now ahead of them.)
- A victim is retracted as a decode round retracts (ScheduleBatch.retract): its KV goes to
  the prefix cache, it keeps its output and re-prefills later, and the result of a forward
  it is in when retracted is dropped (its epoch moved), so no token is lost or doubled.
- Victims rejoin the waiting queue after the round's admissions and rank below the
  request they made room for: none is readmitted ahead of it, and no two requests can
  preempt each other (no thrash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from config.settings import EngineSettings
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler_stats import SchedulerStats

if TYPE_CHECKING:
    from runtime.managers.schedule_policy import PrefillAdder

log = structlog.get_logger("sluice.scheduler")


@dataclass(frozen=True, slots=True)
class PriorityRule:
    sign: int  # 1: larger priority values first; -1: smaller ones first
    threshold: int  # the rank gap preemption needs to exceed (>= 0)

    @classmethod
    def of(cls, settings: EngineSettings) -> PriorityRule:
        return cls(-1 if settings.schedule_low_priority_values_first else 1, settings.priority_scheduling_preemption_threshold)

    def rank(self, req: Req) -> int:
        return req.priority * self.sign

    def outranks(self, req: Req, other: Req) -> bool:
        return self.rank(req) - self.rank(other) > self.threshold


class Preemption:
    def __init__(self, rule: PriorityRule, stats: SchedulerStats) -> None:
        self.rule = rule
        self.stats = stats

    def _victims(self, req: Req, running: ScheduleBatch) -> list[Req]:
        """Running requests `req` may preempt, in the order they go."""
        found = [r for r in running.reqs if not r.finished() and not r.to_abort and r.is_chunked == 0
                 and self.rule.outranks(req, r)]
        found.sort(key=lambda r: (self.rule.rank(r), -r.arrival_time))
        return found

    def may_preempt(self, waiting: list[Req], running: ScheduleBatch) -> bool:
        """Whether the highest-ranked waiting request outranks a running one: a full batch
        is then worth an admission round."""
        if not waiting or running.is_empty():
            return False
        top = max(waiting, key=self.rule.rank)
        return bool(self._victims(top, running))

    def make_room(self, req: Req, running: ScheduleBatch, adder: PrefillAdder, need_row: bool) -> list[Req]:
        """Retract running requests `req` outranks until it has a running slot (if
        `need_row`) and `adder` has the KV to admit it. Returns them (the caller queues
        them after this round's admissions); [] when even all of them would not do, and
        then nothing changed. `req` holds a fresh prefix match (init_next_round_input)."""
        victims = self._victims(req, running)
        if not victims or not adder.budget_allows(req):  # this round's prefill is full anyway
            return []
        ids = {id(r) for r in victims}
        gain = sum(kv + adder.reserved(r) for r, kv in zip(running.reqs, running.seq_lens) if id(r) in ids)
        alone_after = len(victims) == running.batch_size() and not adder.can_run_list
        if adder.deficit(req, alone=alone_after or None) >= gain:
            return []
        gone: list[Req] = []
        for victim in victims:
            if (gone or not need_row) and adder.deficit(req) < 0:
                break
            i = running.reqs.index(victim)
            kv_slots = running.seq_lens[i]
            running.retract(i)
            adder.drop_running(victim)
            victim.trace.preempted(len(victim.output_ids), kv_slots, req.rid, victim.priority)
            gone.append(victim)
            req.init_next_round_input(adder.tree_cache)  # the victim's KV may extend its cached prefix
        self.stats.add("num_preempted_reqs_total", len(gone))
        log.info("Preempt requests.", preempted=len(gone), by=req.rid, priority=req.priority,
                 running=running.batch_size())
        return gone
