"""The output-rate limit inside vLLM's V1 scheduler.

One mixin holds the behaviour; ``OutputRateScheduler`` and
``OutputRateAsyncScheduler`` put it over vLLM's ``Scheduler`` and
``AsyncScheduler``. vLLM's own ``schedule()`` does the scheduling; the mixin
works at the hook points listed in ``vllm_output_rate.internals``:

* before ``schedule()``: read the clock once, rotate each user's streams so
  the one after the last served goes first, move requests whose user has no
  budget behind the others, and, when the active cap binds, put the users
  who waited longest first; then hold those without budget back from
  ``running`` for vLLM's ``schedule()`` (vllm-spyre's way) when the KV cache
  has room for the step, or leave them at the tail, where vLLM's own
  preemption looks first;
* at ``_reserve_prefill_lookahead`` (per request, right before KV
  allocation): charge one token when the step samples, shrink a final
  prefill chunk to stop one position short when the budget is gone (chunked
  prefill), or skip the request (it stays in ``running`` with its KV);
* at ``_handle_blocked_waiting_request`` (``residency``): skip waiting
  requests of users without budget whose prefill cannot advance, and keep
  resident slots for requests with budget (preempting throttled ones for
  them when every slot is taken);
* after ``schedule()``: the single refund point, for every request charged in
  this step that is not in ``num_scheduled_tokens``.

What the limiter did in a step is kept as plain data
(``output_rate_last_step``, an ``observers.StepReport``) and reported to the
registered observers (``vllm_output_rate.observers``: telemetry registers
itself there; this module imports none of it). The engine loop asks
``output_rate_idle_wait_s()`` how long it may wait when no model ran.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.config import (
    ADDITIONAL_CONFIG_KEY,
    OutputRateConfig,
    OutputRateConfigError,
    config_of,
)
from vllm_output_rate.request_fields import resolve_user, trusted_source
from vllm_output_rate import lending
from vllm_output_rate.borrowing import Lender, lender_for
from vllm_output_rate.charges import choose
from vllm_output_rate.planners import plan_residency, plan_running_order
from vllm_output_rate.preemption import PriorityPreemptionMixin
from vllm_output_rate.residency import ResidencyMixin
from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.ledger import OutputRateState, StepLedger
from vllm_output_rate.limiter import Clock, OutputRateLimiter, monotonic_clock
from vllm_output_rate.observers import (
    LimitsChange,
    OutputRateObserver,
    StepReport,
    create_observer,
)

#: Idle users are dropped from the limiter every this many steps.
CLEANUP_EVERY_STEPS = 256
#: Longest idle wait of the engine loop, so that work that becomes ready
#: without a message (a compiled grammar, say) is seen soon enough.
MAX_IDLE_WAIT_S = 0.05

_RUNNING = RequestStatus.RUNNING


class OutputRateSchedulerMixin(ResidencyMixin, PriorityPreemptionMixin):
    """Per-user output-token rate limit over vLLM's V1 scheduler."""

    #: Monotonic ns clock; tests replace it on the instance.
    output_rate_clock: Clock = staticmethod(monotonic_clock)
    #: The registered observers as one (``observers.create_observer``), or
    #: None: told of every step, the outputs, aborts and idle waits.
    output_rate_observer: OutputRateObserver | None = None
    #: Hold throttled running requests back from vLLM's ``schedule()`` when
    #: the KV cache has room for the step (see ``_orl_hold_back``); tests set
    #: False to run every step with them left at the tail of ``running``.
    output_rate_hold_back: bool = True
    #: Watch the limits file from a thread (tests: False, and call ``check()``).
    output_rate_watch_thread: bool = True
    #: The watcher of ``--output-rate-limits-file``, if limits come from one.
    output_rate_limits_watcher: Any = None
    #: Our state on vLLM's scheduler: one object (``ledger``), made before
    #: vLLM's __init__ runs (it sets the active cap, which the state keeps).
    output_rate: OutputRateState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        st = self.output_rate = OutputRateState()
        super().__init__(*args, **kwargs)
        config = config_of(self.vllm_config)
        if config is None:
            raise OutputRateConfigError(
                f"{type(self).__name__} needs additional_config"
                f"[{ADDITIONAL_CONFIG_KEY!r}]; install it with "
                f"vllm_output_rate.plugin.configure_output_rate()"
            )
        self.output_rate_config = config
        choose(st, self._orl_new_limiter(config), Lender(config) if config.borrowing else None)
        st.limiter_begin = getattr(st.limiter, "begin_step", None)
        if config.limits_file is not None:
            from vllm_output_rate.limits_watch import LimitsWatcher

            # (a live watcher re-reads the file on SIGHUP too)
            self.output_rate_limits_watcher = LimitsWatcher(config, start_thread=self.output_rate_watch_thread)
        st.chunked = bool(self.scheduler_config.enable_chunked_prefill)
        st.prefix_caching = bool(self.cache_config.enable_prefix_caching)
        st.priority = self.policy == SchedulingPolicy.PRIORITY
        st.is_async = isinstance(self, AsyncScheduler)
        st.token_budget = self.max_num_scheduled_tokens
        st.max_running = self.max_num_running_reqs
        self._orl_begin(self.output_rate_clock())
        self.output_rate_last_step = st.step.report
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
        self.output_rate_observer = create_observer(SchedulerView(self))

    def _orl_new_limiter(self, config: OutputRateConfig) -> OutputRateLimiter:
        if config.shared_state is None:
            return OutputRateLimiter(config.default_rate, config.user_rates)
        from vllm_output_rate.lease_store import new_engine_id
        from vllm_output_rate.shared_limiter import SharedBudgetLimiter
        from vllm_output_rate.shared_settings import parse_shared_state

        rank = self.vllm_config.parallel_config.data_parallel_index
        return SharedBudgetLimiter(
            config.default_rate, config.user_rates, parse_shared_state(config.shared_state),
            clock=lambda: self.output_rate_clock(), engine_id=new_engine_id(rank),
            start_thread=self.output_rate_watch_thread)

    @property
    def output_rate_limiter(self) -> OutputRateLimiter:
        """The budgets (``output_rate.limiter``); set, the step's charges
        are chosen again (``charges.choose``)."""
        return self.output_rate.limiter

    @output_rate_limiter.setter
    def output_rate_limiter(self, limiter: OutputRateLimiter) -> None:
        choose(self.output_rate, limiter, self.output_rate.lender)

    # -- vLLM's admission cap -------------------------------------------

    @property
    def max_num_active_reqs(self) -> int:
        """Admission cap of the waiting loop: throttled requests don't count
        against the active cap; held-back ones (out of ``running`` while
        vLLM schedules) still count against the resident cap."""
        st = self.output_rate
        step = st.step
        if step is None:  # (vLLM's __init__ runs)
            return min(st.base_active, self.max_num_running_reqs)
        return min(
            st.base_active + step.throttled_running,
            self.max_num_running_reqs - step.held,
        )

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self.output_rate.base_active = value

    # -- requests --------------------------------------------------------

    def add_request(self, request: Request) -> None:
        # Resolved once per request, read by attribute on every step after.
        # The identity: who the request says it is; the user: whose budget
        # it spends (the same, or __unlisted__ in "shared" mode).
        extra_args = request.sampling_params.extra_args if request.sampling_params else None
        identity = request.output_rate_identity = resolve_user(extra_args)
        #: "header" / "api_key" when the API server vouches for the user
        request.output_rate_trusted = trusted_source(extra_args)
        request.output_rate_user = self.output_rate_config.charged_user(identity)
        # The user's limiter state, once first charged (the plain limiter
        # only; forgotten when the limiter drops or replaces it).
        request.output_rate_state = None
        # The last step that throttled it (StepReport.throttled_new).
        request.output_rate_throttled_step = -1
        # When a token was last dispatched for it (rotation, cross-user order).
        request.output_rate_served_ns = 0
        # The step it may borrow in (set when the scheduler lends to it).
        request.output_rate_borrow_step = -1
        super().add_request(request)
        observer = self.output_rate_observer
        if observer is not None:
            observer.on_request(request.request_id)

    # -- the step --------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        now = self.output_rate_clock()
        watcher = self.output_rate_limits_watcher
        if watcher is not None and watcher.current is not self.output_rate_config:
            self._orl_apply_limits(watcher.current, now)
        # Reordering matters once some user ran short (a step refused
        # someone) or when more requests are resident than may run.
        st = self.output_rate
        was_short = bool(st.step.refused)
        step = self._orl_begin(now)
        # the step's plans, applied before vLLM schedules (``planners``, ``lending``)
        if st.lender is not None:
            step.lending = lending.plan_lending(self.waiting, self.running, st, step)
        self._orl_apply_residency(plan_residency(
            self.running, self.waiting, st, step, st.limiter.rate_of,
            self._request_blocks_can_be_freed))
        running = len(self.running)
        # Only when more are resident than may run can the active cap bind.
        step.capped = running > st.base_active
        throttled = None
        if running > 1 and (was_short or step.capped) or (
                running and (st.lender is not None or step.turns)):
            # (with borrowing every step: who borrows is decided here)
            throttled = self._orl_order_running()
        held = self._orl_hold_back(throttled) if throttled else None
        t1 = time.perf_counter()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if held:
                self.running.extend(held)
                step.held = 0
        t2 = time.perf_counter()
        self._orl_finish(output.num_scheduled_tokens, output.preempted_req_ids)
        observer = self.output_rate_observer
        if observer is not None:
            t3 = time.perf_counter()
            step.report.limiter_share = ((t1 - t0) + (t3 - t2)) / (t3 - t0)
            observer.on_step(step.report)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        observer = self.output_rate_observer
        if observer is not None:
            observer.on_outputs(outputs)
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        observer = self.output_rate_observer
        if observer is not None and finished:
            observer.on_aborted([(r.request_id, r.output_rate_user) for r in finished],
                                self.output_rate_clock())
        return finished

    def _orl_apply_limits(self, config: OutputRateConfig, now: int) -> None:
        """Put reloaded limits in force at this step boundary: the limiter
        converts live users' state (``OutputRateLimiter.set_limits``), the
        requests' budgets are re-resolved when unlisted users share one,
        and the observers are told."""
        from vllm_output_rate.limits_watch import diff_limits

        old = self.output_rate_config
        self.output_rate_limiter.set_limits(config.default_rate, config.user_rates, now)
        self.output_rate_config = config
        st = self.output_rate
        choose(st, st.limiter, lender_for(config, st.lender, now))
        if "shared" in (old.unlisted_users, config.unlisted_users):
            charged_user = config.charged_user
            for request in self.requests.values():
                request.output_rate_user = charged_user(request.output_rate_identity)
        self._orl_forget_states(None)
        added, removed, changed = diff_limits(old, config)
        observer = self.output_rate_observer
        if observer is not None:
            observer.on_limits(LimitsChange(
                now, old.digest, config.digest, config.default_rate, old.default_rate,
                dict(config.user_rates), tuple(added), tuple(removed), tuple(changed)))

    def shutdown(self) -> None:
        watcher = self.output_rate_limits_watcher
        if watcher is not None:
            watcher.close()
        observer = self.output_rate_observer
        if observer is not None:
            self.output_rate_observer = None
            observer.close()
        close = getattr(self.output_rate_limiter, "close", None)
        if close is not None:
            close()
        super().shutdown()

    def _orl_begin(self, now: int) -> StepLedger:
        """A step begins at ``now``: its ledger (``ledger.StepLedger``)."""
        st = self.output_rate
        st.step_no += 1
        self._orl_track_period(now)
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
        return step

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

    def _orl_hold_back(self, throttled: list[Request]) -> list[Request] | None:
        """Take the throttled tail out of ``running`` while vLLM schedules,
        as vllm-spyre holds requests back: they cost vLLM's loop nothing and
        keep their KV blocks and worker slot. They are refused here, once
        each, as the charge point would have refused them.

        Only when the step cannot run out of KV blocks (every request left
        one new block, the token budget's worth of prefill, per KV cache
        group): under pressure they stay at the tail, where vLLM's own FCFS
        preemption (or ours, with PRIORITY) takes them first. Not with LoRA
        (vLLM counts the adapters of all of ``running``)."""
        if not self.output_rate_hold_back or self.lora_config:
            return None
        st = self.output_rate
        step = st.step
        running = self.running
        lent = step.lent_tail  # borrowers after them (borrowing only)
        keep = len(running) - len(throttled) - lent
        if not st.kv_fits(keep + lent):
            return None
        del running[keep:keep + len(throttled)]
        step.held = step.report.held_back = len(throttled)
        refused = step.refused
        mark = self._orl_mark_throttled
        for request in throttled:
            refused[request.output_rate_user] = 0  # ready time filled in at the end
            mark(request)
        return throttled

    # -- the charge point ------------------------------------------------

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        # The charge point: vLLM calls this for every running and waiting
        # request it is about to give tokens to, right before KV allocation.
        if self.num_prefill_lookahead:  # 0 unless multi-module MTP drafting
            num_new_tokens = super()._reserve_prefill_lookahead(
                request, num_computed_tokens, num_new_tokens
            )
        if num_new_tokens <= 0:
            return 0
        st = self.output_rate
        step = st.step
        running = request.status == _RUNNING
        capped = running and step.capped
        if capped and step.active >= st.base_active:
            step.report.cap_deferred += 1
            return 0
        # A step samples when it reaches the end of the known sequence. A
        # running request past its prefill always does (checked first: cheap).
        if (running and not request.is_prefill_chunk) or (
            num_computed_tokens + num_new_tokens >= request.num_tokens
        ):
            # Charge one token, once per step (``charges``), or lend one.
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
                    return self._orl_refuse(request, user, num_computed_tokens)
        if capped:
            step.active += 1
        step.charges.give(request, num_new_tokens)  # (the room of a lending step)
        return num_new_tokens

    def _orl_refuse(self, request: Request, user: str, num_computed_tokens: int) -> int:
        st = self.output_rate
        step = st.step
        step.refused[user] = 0  # ready time filled in when the step ends
        running = request.status == _RUNNING
        if st.chunked:
            # Advance the prefill to the second-to-last position; the first
            # token is sampled in a later step, when budget returns.
            held = request.num_tokens - 1 - num_computed_tokens
            if held > 0:
                step.report.prefill_held += 1
                if running:
                    step.active += 1
                step.charges.give(request, held)
                return held
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

    # -- the refund point and the step record -------------------------------

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
        limiter = st.limiter
        refused = record.refused
        for user in refused:
            refused[user] = limiter.ready_at_ns(user)
        if refused or len(self.running) > st.base_active:
            # Served times feed the next step's rotation, which only runs
            # after a step that refused someone (see schedule()).
            now, requests = step.now, self.requests
            for req_id in (*charged, *record.borrowed):
                requests[req_id].output_rate_served_ns = now
        self.output_rate_last_step = record

    def output_rate_idle_wait_s(self) -> float | None:
        """How long the engine loop may wait after a step that ran nothing.

        ``min(50 ms, earliest ready_at among users refused in the last step
        - now)``; None when no user was refused (then vLLM's own behaviour).
        """
        refused = self.output_rate.step.refused
        if not refused:
            return None
        earliest = min(refused.values())
        wait = (earliest - self.output_rate_clock()) / 1e9
        return min(MAX_IDLE_WAIT_S, wait) if wait > 0 else 0.0

    def output_rate_wake_target_ns(self) -> int | None:
        """The earliest ready_at among users refused in the last step."""
        refused = self.output_rate.step.refused
        return min(refused.values()) if refused else None


class OutputRateScheduler(OutputRateSchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with per-user output-rate limits."""


class OutputRateAsyncScheduler(OutputRateSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with per-user output-rate limits."""
