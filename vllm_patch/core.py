"""The limiter's step over vLLM's scheduler: where a token is charged and
where a step's room is decided.

A step begins with a ledger (``ledger.StepLedger``: the clock read once, the
step's charges, ``charges``), then the step's plans (``planners``,
``lending``) are applied before vLLM's ``schedule()`` runs: the lending
room, residency's kept slots and preemptions, ``running`` ordered, the
throttled tail held back. vLLM's loop calls the charge point for every
request it is about to give tokens to (``_orl_charge``: one token charged,
lent, or refused); after ``schedule()`` the single refund point gives back
what was charged and not dispatched, and the charges are settled
(``_orl_finish``). Reloaded limits are put in force at a step boundary
(``_orl_apply_limits``).

``OutputRateCore`` (over the prompt budgets' part, ``prompt_points``) is
mixed by ``scheduler`` over vLLM's ``Scheduler``; it reads and calls what
``host.SchedulerHost`` declares, and keeps its state in the host's
``output_rate`` (``ledger.OutputRateState``).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate import lending
from vllm_output_rate.borrowing import Lender, lender_for
from vllm_output_rate.charges import DirectCharges, choose
from vllm_output_rate.config import (
    ADDITIONAL_CONFIG_KEY,
    OutputRateConfig,
    OutputRateConfigError,
    config_of,
)
from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.ledger import StepLedger
from vllm_output_rate.limiter import OutputRateLimiter, take_from
from vllm_output_rate.observers import LimitsChange, StepReport, create_observer
from vllm_output_rate.planners import plan_residency, plan_running_order
from vllm_output_rate.prompt_budget import PromptBudgets, check_shared
from vllm_output_rate.prompt_points import PromptPointsMixin
from vllm_output_rate.request_fields import resolve_user, trusted_source

#: Idle users are dropped from the limiter every this many steps.
CLEANUP_EVERY_STEPS = 256

_RUNNING = RequestStatus.RUNNING


class OutputRateCore(PromptPointsMixin):
    """The limiter's step (see the module)."""

    # -- start-up and requests ----------------------------------------------

    def _orl_start(self) -> None:
        """After vLLM's ``__init__``: the limits, the limiter and the charges
        they make, vLLM's settings read once, the first ledger, the PRIORITY
        policy's wrap, the engine loop's idle wait and the observers."""
        st = self.output_rate
        config = config_of(self.vllm_config)
        if config is None:
            raise OutputRateConfigError(
                f"{type(self).__name__} needs additional_config"
                f"[{ADDITIONAL_CONFIG_KEY!r}]; install it with "
                f"vllm_output_rate.plugin.configure_output_rate()"
            )
        st.config = config
        st.chunked = bool(self.scheduler_config.enable_chunked_prefill)
        problem = check_shared(config, st.chunked)
        if problem:
            raise OutputRateConfigError(problem)
        st.limiter = self._orl_new_limiter(config)  # (the others' maker: ``_orl_second``)
        choose(st, st.limiter,
               Lender(config, self._orl_second("ceiling")) if config.borrowing else None)
        st.prompts = (PromptBudgets(config, make=self._orl_second("prompt"))
                      if config.prompt_budgets else None)
        st.prefill_ahead = config.prefill_ahead
        st.limiter_begin = getattr(st.limiter, "begin_step", None)
        if config.limits_file is not None:
            from vllm_output_rate.limits_watch import LimitsWatcher

            # (a live watcher re-reads the file on SIGHUP too; it refuses
            # what this engine cannot serve)
            st.watcher = LimitsWatcher(config, start_thread=self._orl_watch_thread(),
                                       refuse=lambda c: check_shared(c, st.chunked))
        st.prefix_caching = bool(self.cache_config.enable_prefix_caching)
        st.priority = self.policy == SchedulingPolicy.PRIORITY
        st.is_async = isinstance(self, AsyncScheduler)
        st.token_budget = self.max_num_scheduled_tokens
        st.max_running = self.max_num_running_reqs
        self._orl_begin(st.clock())
        st.last_step = st.step.report
        # KV blocks a step can allocate beyond one a request (prefill chunks take the token
        # budget at most), per KV cache group: the room throttled ones may be held back within.
        st.groups = max(len(self.kv_cache_config.kv_cache_groups), 1)
        st.block_size = self.block_size
        st.step_blocks = st.blocks_for(self.max_num_scheduled_tokens)
        st.free_blocks = self.kv_cache_manager.block_pool.get_num_free_blocks
        # FCFS preempts the tail of ``running``, where throttled requests sit: no wrap. PRIORITY
        # picks by priority and arrival: a throttled one of the lowest priority first (wrapped).
        st.upstream_allocate = self.kv_cache_manager.allocate_slots
        if st.priority:
            self.kv_cache_manager.allocate_slots = self._orl_allocate_slots

        from vllm_output_rate import engine_loop, orphan

        engine_loop.install()
        orphan.watch_parent(getattr(st.limiter, "close", None))  # (API server gone)
        st.observer = create_observer(SchedulerView(self))

    def _orl_watch_thread(self) -> bool:
        """Whether the limits file (and the shared store) are watched from a
        thread (``OutputRateState.watch_thread``; the host may say no)."""
        return self.output_rate.watch_thread

    def _orl_new_limiter(self, config: OutputRateConfig) -> OutputRateLimiter:
        if config.shared_state is None:
            return OutputRateLimiter(config.default_rate, config.user_rates)
        from vllm_output_rate.lease_store import new_engine_id
        from vllm_output_rate.shared_limiter import SharedBudgetLimiter
        from vllm_output_rate.shared_settings import parse_shared_state

        st = self.output_rate
        rank = self.vllm_config.parallel_config.data_parallel_index
        return SharedBudgetLimiter(
            config.default_rate, config.user_rates, parse_shared_state(config.shared_state),
            clock=lambda: st.clock(), engine_id=new_engine_id(rank),
            start_thread=self._orl_watch_thread())

    def _orl_second(self, kind: str) -> Any:
        """Makes the limiter of the users' ceilings or prompt budgets
        (``kind``): with shared budgets a fleet-wide one, leased by the
        same lease thread (``SharedBudgetLimiter.second_budget``); else
        None (the engine's own)."""
        second = getattr(self.output_rate.limiter, "second_budget", None)
        return None if second is None else (lambda rate, rates: second(kind, rate, rates))

    def _orl_add(self, request: Request) -> None:
        """A new request: its user resolved once, read by attribute on every
        step after. The identity: who the request says it is; the user:
        whose budget it spends (the same, or __unlisted__ in "shared" mode)."""
        extra_args = request.sampling_params.extra_args if request.sampling_params else None
        identity = request.output_rate_identity = resolve_user(extra_args)
        #: "header" / "api_key" when the API server vouches for the user
        request.output_rate_trusted = trusted_source(extra_args)
        request.output_rate_user = self.output_rate.config.charged_user(identity)
        # The user's limiter state, once first charged (the plain limiter
        # only; forgotten when the limiter drops or replaces it).
        request.output_rate_state = None
        # The last step that throttled it (StepReport.throttled_new).
        request.output_rate_throttled_step = -1
        # When a token was last dispatched for it (rotation, cross-user order).
        request.output_rate_served_ns = 0
        # The step it may borrow in (set when the scheduler lends to it).
        request.output_rate_borrow_step = -1
        # The reasons its prompt was put off so far (``prompt_points.DEFER_BITS``: each
        # reported once, ``StepReport.prompt_deferred``).
        request.output_rate_deferred = 0

    # -- before vLLM's schedule() -----------------------------------------------

    def _orl_before_schedule(self) -> list[Request] | None:
        """A step begins: reloaded limits put in force, the ledger, the
        plans applied, ``running`` ordered; returns the throttled requests
        held out of ``running`` while vLLM schedules (None: none)."""
        st = self.output_rate
        now = st.clock()
        watcher = st.watcher
        if watcher is not None and watcher.current is not st.config:
            self._orl_apply_limits(watcher.current, now)
        # Reordering matters once some user ran short (a step refused
        # someone) or when more requests are resident than may run.
        was_short = bool(st.step.refused)
        step = self._orl_begin(now)
        # the step's plans (``lending``, ``planners``), applied
        if st.lender is not None:
            step.lending = lending.plan_lending(self.waiting, self.running, st, step)
        # the last step's held tail, taken as it is while its users have no budget (``held``)
        tail = st.held_tail.resume(self.running, step) if st.held_tail.requests else None
        self._orl_apply_residency(plan_residency(
            self.running, self.waiting, st, step, st.limiter.rate_of,
            self._request_blocks_can_be_freed))
        lending.plan_jit_room(self.waiting, self.running, st, step)
        running = len(self.running)
        # Only when more are resident than may run can the active cap bind.
        step.capped = running > st.base_active
        # (a step keeping room just in time counts every token given: ``charges.RoomCharges``)
        step.direct = not step.capped and st.charges is DirectCharges and st.prompts is None \
            and step.jit_room is None
        throttled = None
        if tail is not None:
            if st.held_tail.intact(self.running):
                front = self.running[:-len(tail)]
                order = plan_running_order(front, st, step)  # (short: held users have no budget)
                self.running[:] = order.ready + order.throttled + tail
                return self._orl_hold_back(order.throttled, tail)
            st.held_tail.release()  # (residency preempted one of them)
        if running > 1 and (was_short or step.capped) or (
                running and (st.lender is not None or step.turns)):
            # (with borrowing every step: who borrows is decided here)
            throttled = self._orl_order_running()
        return self._orl_hold_back(throttled) if throttled else None

    def _orl_begin(self, now: int) -> StepLedger:
        """A step begins at ``now``: its ledger (``ledger.StepLedger``)."""
        st = self.output_rate
        st.step_no += 1
        prev = st.prev_now
        if prev is not None and self.running and now > prev:
            # the step period, a moving average over the steps that began
            # with requests running (an idle engine's wait is no period):
            # how many streams a user's rate keeps busy (``planners.sustained``)
            period = st.period_ns
            dt = now - prev
            st.period_ns = dt if period is None else (7 * period + dt) // 8
        st.prev_now = now
        lender = st.lender
        step = st.step = StepLedger(st.step_no, now, StepReport(st.step_no, now))
        step.charges = st.charges(st, step)  # (``charges``: chosen with the limiter)
        begin = st.limiter_begin
        if begin is not None:
            begin(now)
        if st.step_no % CLEANUP_EVERY_STEPS == 0:
            dropped = st.limiter.cleanup_idle_users(now)
            if dropped:
                self._orl_forget_states(set(dropped))
            if lender is not None:
                lender.cleanup_idle_users(now)
            if st.prompts is not None:
                st.prompts.cleanup_idle_users(now)
        return step

    def _orl_apply_limits(self, config: OutputRateConfig, now: int) -> None:
        """Put reloaded limits in force at this step boundary: the limiter
        converts live users' state (``OutputRateLimiter.set_limits``), the
        charges are chosen again (borrowing may start or stop), the
        requests' budgets are re-resolved when unlisted users share one,
        and the observers are told."""
        from vllm_output_rate.limits_watch import diff_limits

        st = self.output_rate
        old = st.config
        st.limiter.set_limits(config.default_rate, config.user_rates, now)
        st.config = config
        choose(st, st.limiter, lender_for(config, st.lender, now, self._orl_second("ceiling")))
        if not config.prompt_budgets:
            if st.prompts is not None:
                st.prompts.close()
            st.prompts = None
        elif st.prompts is None:
            st.prompts = PromptBudgets(config, make=self._orl_second("prompt"))
        else:
            st.prompts.set_config(config, now)
        if "shared" in (old.unlisted_users, config.unlisted_users):
            charged_user = config.charged_user
            for request in self.requests.values():
                request.output_rate_user = charged_user(request.output_rate_identity)
        self._orl_forget_states(None)
        st.held_tail.hold(st.step_no, [], [], None, False)  # (their budgets changed)
        added, removed, changed = diff_limits(old, config)
        observer = st.observer
        if observer is not None:
            observer.on_limits(LimitsChange(
                now, old.digest, config.digest, config.default_rate, old.default_rate,
                dict(config.user_rates), tuple(added), tuple(removed), tuple(changed)))

    def _orl_forget_states(self, users: set[str] | None) -> None:
        """The limiter dropped (``users``) or replaced (None: any) some
        users' states: their requests look theirs up again when next
        charged."""
        for request in self.requests.values():
            if users is None or request.output_rate_user in users:
                request.output_rate_state = None

    def _orl_order_running(self) -> list[Request] | None:
        """``running`` in the step's order (``planners.plan_running_order``;
        with borrowing, the borrowers after the throttled requests,
        ``lending.plan_lend_tail``). Returns the throttled requests now at
        the tail of ``running`` (those of users without budget at the
        step's start, less a waiting request's turn), or None when no user
        is short of budget."""
        st = self.output_rate
        step = st.step
        order = plan_running_order(self.running, st, step)
        if order is None:
            return None
        book = step.lending
        if book is None or not book.lends:
            self.running[:] = order.ready + order.throttled
            return order.throttled if order.short else None
        tail = lending.plan_lend_tail(order, st, step)
        step.charges.at_ceiling.update(tail.at_ceiling)
        for request in tail.chosen:
            if request.status != _RUNNING:
                # a waiting one chosen: its room kept as for a waiting
                # request with budget (else one admitted before it to
                # compute its prefill ahead could take its active slot)
                lending.keep(book, request, st)
        book.chose = True
        for request in tail.chosen:  # the charge point may lend to these
            request.output_rate_borrow_step = step.no
        self.running[:] = tail.ready + tail.throttled + tail.borrowers
        step.lent_tail = len(tail.borrowers)
        return tail.throttled if order.short else None

    def _orl_hold_back(self, throttled: list[Request], tail: list | None = None) -> list | None:
        """Take the throttled tail out of ``running`` while vLLM schedules,
        as vllm-spyre holds requests back: they cost vLLM's loop nothing and
        keep their KV blocks and worker slot. They are refused here, once
        each, as the charge point would have refused them.

        Only when the step cannot run out of KV blocks (every request left
        one new block, the token budget's worth of prefill, per KV cache
        group): under pressure they stay at the tail, where vLLM's own FCFS
        preemption (or ours, with PRIORITY) takes them first. Not with LoRA
        (vLLM counts the adapters of all of ``running``). ``tail``: the last
        step's, after ``throttled``, taken as it was (``held``)."""
        st = self.output_rate
        if not st.hold_back or self.lora_config:
            return None
        step, held = st.step, st.held_tail
        running = self.running
        lent = step.lent_tail  # borrowers after them (borrowing only)
        every = throttled + tail if tail else throttled
        keep = len(running) - len(every) - lent
        if not st.kv_fits(keep + lent):
            held.hold(step.no, [], [], None, False)  # (the tail is marked at the charge point)
            return None
        del running[keep:keep + len(every)]
        step.held = step.report.held_back = len(every)
        refused = step.refused
        mark = self._orl_mark_throttled
        for request in throttled:
            refused[request.output_rate_user] = 0  # ready time filled in at the end
            mark(request)
        ids = step.report.throttled[-len(throttled):] if throttled else []
        if tail:  # throttled in the step before: none newly, their ready times known
            step.report.throttled.extend(held.ids)
            refused.update(held.ready)
            step.refused_known = held.ready
        held.hold(step.no, throttled, ids, tail,  # (limits reloaded: ``_orl_apply_limits``)
                  st.charges is DirectCharges and st.prompts is None and not st.priority)
        return every

    # -- the charge point ------------------------------------------------------

    def _orl_charge(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's ``_reserve_prefill_lookahead`` itself (hook 2: ``scheduler``
        names this function for it, one frame a request): vLLM is about to
        give ``request`` ``num_new_tokens`` tokens (vLLM's own look-ahead
        reservation first, when multi-module MTP drafting sets one): a
        prompt budget cuts the chunk to what it allows (or puts it off);
        when the step samples, charge one token (once per step), or lend
        one, or refuse (``_orl_refuse``); a prefill chunk that samples
        nothing waits for its user's budget (just in time) unless prompts
        are computed ahead; the tokens it may compute."""
        if self.num_prefill_lookahead:  # (0 unless multi-module MTP drafting)
            num_new_tokens = Scheduler._reserve_prefill_lookahead(
                self, request, num_computed_tokens, num_new_tokens)
        if num_new_tokens <= 0:
            return 0
        st = self.output_rate
        step = st.step
        running = request.status == _RUNNING
        if running and step.direct and not request.is_prefill_chunk and (
                num_computed_tokens >= request.num_prompt_tokens):
            # (the common case: a decode token charged on its user's state kept on the request)
            req_id, charged, state = request.request_id, step.charged, request.output_rate_state
            if req_id in charged or state is not None and take_from(state, step.now):
                charged[req_id] = request.output_rate_user
                return num_new_tokens
        capped = running and step.capped
        if capped and step.active >= st.base_active:
            step.report.cap_deferred += 1
            return 0
        prompts = st.prompts
        if prompts is not None and num_computed_tokens < request.num_prompt_tokens:
            num_new_tokens = self._orl_prompt_cut(request, num_computed_tokens, num_new_tokens)
            if num_new_tokens <= 0:
                return 0
        # A step samples when it reaches the end of the known sequence. A
        # running request past its prefill always does (checked first: cheap).
        if (running and not request.is_prefill_chunk) or (
            num_computed_tokens + num_new_tokens >= request.num_tokens
        ):
            charged = step.charged
            req_id = request.request_id
            if req_id not in charged:
                user = request.output_rate_user
                charges = step.charges
                if charges.take(request, user):
                    charged[req_id] = user
                elif charges.lend(request, user, num_new_tokens):
                    step.report.borrowed[req_id] = user
                else:
                    return self._orl_refuse(request, user, num_computed_tokens, num_new_tokens)
        elif not st.prefill_ahead and st.lender is None and (
                lending.jit_room(step, request, num_new_tokens) < num_new_tokens  # (cut: held)
                or not self._orl_in_time(request, request.num_tokens - num_computed_tokens
                                         - num_new_tokens, num_new_tokens, spent=num_new_tokens)):
            # just in time: not computed before its user may sample
            return self._orl_refuse(request, request.output_rate_user, num_computed_tokens,
                                     num_new_tokens)
        if capped:
            step.active += 1
        charges = step.charges
        if charges.gives:  # (the room of a lending step)
            charges.give(request, num_new_tokens)
        if num_computed_tokens < request.num_prompt_tokens:
            self._orl_prompt_take(request, num_computed_tokens, num_new_tokens)
        return num_new_tokens

    def _orl_in_time(self, request: Request, after: int, chunk: int, claimed: int = 0,
                     spent: int = 0) -> bool:
        """Just in time: whether a prefill with ``after`` tokens still to
        compute after this chunk (chunks of about ``chunk`` tokens, a step
        each at the engine's step period; no faster than its user's prompt
        budget grants them) ends no earlier than the token it waits for:
        its user's next one (it has budget now, or its budget returns by
        then), or, ``claimed`` tokens of its user's running requests still
        to come first, the one after those (``spent``: prompt tokens of its
        user's budget this chunk takes now)."""
        st = self.output_rate
        step = st.step
        user = request.output_rate_user
        if not claimed and step.charges.left(user) > 0:
            return True
        steps = -(-after // max(chunk, 1)) + 1
        takes = steps * (st.period_ns or 0)
        prompts = st.prompts
        if prompts is not None:
            takes = max(takes, prompts.eta_ns(user, step.now, after + spent))
        due = max(st.limiter.ready_at_ns(user), step.now)
        if claimed:
            rate = st.limiter.rate_of(user)
            due += claimed * rate.denominator * 1_000_000_000 // rate.numerator
        if due - step.now <= takes:
            return True
        # put off: the engine wakes when it is in time
        jit = step.jit_waits
        at = due - takes
        if at < jit.get(user, at + 1):
            jit[user] = at
        return False

    def _orl_refuse(self, request: Request, user: str, num_computed_tokens: int,
                    num_new_tokens: int) -> int:
        st = self.output_rate
        step = st.step
        step.refused[user] = 0  # ready time filled in when the step ends
        running = request.status == _RUNNING
        left = request.num_tokens - 1 - num_computed_tokens
        # never more than vLLM gave the chunk (its token budget, the
        # long-prefill threshold): vLLM asserts the step's sum
        want = min(left, num_new_tokens)
        held = lending.jit_room(step, request, want)  # (just in time: the room not kept)
        # Advance the prefill toward the second-to-last position; the first
        # token is sampled in a later step, when budget returns: ahead, or
        # just in time (a waiting request is admitted only then:
        # ``residency``; a 0 here would end vLLM's waiting loop for everyone
        # behind it)
        if st.chunked and held > 0 and (st.prefill_ahead or st.lender is not None or not running
                                        or self._orl_in_time(request, left - held, held)):
            step.report.prefill_held += 1
            if running:
                step.active += 1
            if step.charges.gives:
                step.charges.give(request, held)
            if num_computed_tokens < request.num_prompt_tokens:  # (its prompt's tokens)
                self._orl_prompt_take(request, num_computed_tokens, held)
            return held
        if want > 0:
            step.report.prefill_deferred += 1
            if not st.prefill_ahead and st.lender is None:
                self._orl_prompt_put_off(request, "just_in_time", num_computed_tokens)
        if running:
            step.throttled_running += 1
            self._orl_mark_throttled(request)
        return 0

    def _orl_mark_throttled(self, request: Request) -> None:
        """Record a running request skipped in this step for lack of budget
        (at the charge point, or held back): in ``throttled``, and in
        ``throttled_new`` unless the step before throttled it too."""
        req_id = request.request_id
        report = self.output_rate.step.report
        report.throttled.append(req_id)
        step = report.step
        if request.output_rate_throttled_step != step - 1:
            report.throttled_new.append(req_id)
        request.output_rate_throttled_step = step

    # -- after vLLM's schedule(): the refund point and the step record -----------

    def _orl_after_schedule(self, output: Any, t0: float, t1: float) -> None:
        """The step ends (``output``: vLLM's ``SchedulerOutput``): refunds and
        settling (``_orl_finish``), and the step's report to the observers
        (with the limiter's share of ``schedule()`` since ``t0``, vLLM's own
        from ``t1``)."""
        t2 = time.perf_counter()
        self._orl_finish(output.num_scheduled_tokens, output.preempted_req_ids)
        st = self.output_rate
        observer = st.observer
        if observer is not None:
            t3 = time.perf_counter()
            report = st.step.report
            report.limiter_share = ((t1 - t0) + (t3 - t2)) / (t3 - t0)
            report.scheduled_tokens = output.total_num_scheduled_tokens
            report.scheduled_requests = len(output.num_scheduled_tokens)
            observer.on_step(report)

    def _orl_finish(self, scheduled: dict[str, int], preempted: set[str]) -> None:
        st = self.output_rate
        step = st.step
        record = step.report
        charged = record.charged
        charges = step.charges
        for req_id in () if charged.keys() <= scheduled.keys() else charged.keys() - scheduled.keys():
            # The single refund point: charged but not dispatched.
            user = charged.pop(req_id)
            charges.refund(user)
            reason = "preempted" if req_id in preempted else "not_scheduled"
            record.refunded.append((req_id, user, reason))
        charges.settle(record, scheduled)  # (settled limiters: the step's net charges)
        chunks = record.prompt_chunks
        if chunks and not chunks.keys() <= scheduled.keys():
            for req_id in chunks.keys() - scheduled.keys():
                del chunks[req_id]  # (not dispatched: not computed)
        prompts = st.prompts
        if prompts is not None:
            prompts.finish_step(step.prompt_charged, step.prompt_waits, step.now, scheduled)
        limiter, lender = st.limiter, st.lender
        refused = record.refused
        known = step.refused_known
        refused.update(known or {})  # (held users: the charge point may have refused them again)
        for user in refused if known is None else refused.keys() - known.keys():
            # (a token needs its ceiling's too)
            refused[user] = max(limiter.ready_at_ns(user),
                                0 if lender is None else lender.ready_at_ns(user))
        st.held_tail.ended(refused)
        if refused or len(self.running) > st.base_active:
            # Served times feed the next step's rotation, which only runs
            # after a step that refused someone (``_orl_before_schedule``).
            now, requests = step.now, self.requests
            for req_id in (*charged, *record.borrowed):
                requests[req_id].output_rate_served_ns = now
        st.last_step = record
