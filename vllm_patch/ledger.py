"""The output-rate state the scheduler keeps: one object on vLLM's scheduler
(``OutputRateState``, its ``output_rate`` attribute), and in it one ledger
per step (``StepLedger``), made new when ``schedule()`` begins.

The state holds what lives across steps: the limiter, the lender
(borrowing's ceilings, None without them) and the kind of charges they make
(``charges``), the settings read once at start-up (chunked prefill, prefix
caching, the PRIORITY policy, async scheduling, the KV cache's groups), the
step count and the engine's step period. The ledger holds what one step
decides and spends: its clock reading and its report
(``observers.StepReport``), its charges (``charges.Charges``: each user's
budget as the step found it and what is left of it), the requests charged,
refused and throttled, the active slots given, the resident slots and turns
kept for waiting requests, and, with borrowing, the room of the step
(``LendingBook``). Nothing of a step
outlives the next step's ledger; the scheduler's mixins (``scheduler``,
``residency``, ``lending``, ``preemption``) read and write these objects,
never attributes of their own on vLLM's scheduler.

Pure data: imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from vllm_output_rate.held import HeldTail
from vllm_output_rate.limiter import monotonic_clock
from vllm_output_rate.ordering import streams_by_user

if TYPE_CHECKING:
    from vllm_output_rate.borrowing import Lender
    from vllm_output_rate.config import OutputRateConfig
    from vllm_output_rate.limiter import OutputRateLimiter
    from vllm_output_rate.observers import OutputRateObserver, StepReport

Request = Any

#: Longest idle wait of the engine loop, so that work that becomes ready
#: without a message (a compiled grammar, say) is seen soon enough.
MAX_IDLE_WAIT_S = 0.05


@dataclass(slots=True, eq=False)
class LendingBook:
    """A lending step's room (``lending``): what it gave and what it keeps
    for waiting requests, against the step's capacity, and the borrowers.
    (The ceilings' books are the step's ``charges.CeilingCharges``.)"""

    #: the step's capacity: active slots, tokens, and the KV-room check
    #: (``OutputRateState.kv_fits``)
    active_cap: int
    token_budget: int
    kv_fits: Callable[..., bool]
    #: active slots and tokens given in this step (the charge point)
    given_slots: int = 0
    given_tokens: int = 0
    #: request id -> (prompt tokens, KV blocks) kept for it; their sums
    kept: dict[str, tuple[int, int]] = field(default_factory=dict)
    kept_slots: int = 0
    kept_tokens: int = 0
    kept_blocks: int = 0
    #: waiting requests that may borrow (a few per user, in queue order)
    waiting_borrowers: list[Request] = field(default_factory=list)
    #: whether this step chose among the borrowers (``lending.plan_lend_tail``)
    chose: bool = False
    #: whether this step lends at all (its kept room fits)
    lends: bool = True

    def keep(self, req_id: str, tokens: int, blocks: int) -> None:
        """Keep room for waiting request ``req_id``: an active slot, its
        prompt's ``tokens`` and their KV ``blocks`` (once)."""
        if req_id in self.kept:
            return
        self.kept[req_id] = (tokens, blocks)
        self.kept_slots += 1
        self.kept_tokens += tokens
        self.kept_blocks += blocks

    def give(self, req_id: str, n: int) -> None:
        """The charge point gave request ``req_id`` ``n`` tokens of this
        step (one active slot): off the room, and off what was kept for it."""
        self.given_slots += 1
        self.given_tokens += n
        kept = self.kept.pop(req_id, None)
        if kept is not None:
            self.kept_slots -= 1
            self.kept_tokens -= kept[0]
            self.kept_blocks -= kept[1]

    def room(self, n: int, req_id: str) -> bool:
        """Whether ``n`` more tokens of request ``req_id`` (one more active
        slot, their KV blocks) fit in this step beside what it gave and what
        it keeps for other waiting requests (with budget, or chosen to
        borrow)."""
        slots, tokens, blocks = self.kept_slots, self.kept_tokens, self.kept_blocks
        own = self.kept.get(req_id)
        if own is not None:  # (its own room, kept for it)
            slots, tokens, blocks = slots - 1, tokens - own[0], blocks - own[1]
        return (self.given_slots + 1 + slots <= self.active_cap
                and self.given_tokens + n + tokens <= self.token_budget
                and self.kv_fits(0, n, blocks))

    def tokens_left(self, req_id: str) -> int:
        """The step's tokens neither given nor kept for waiting requests
        other than ``req_id`` (below 0 when more are kept than the budget)."""
        own = self.kept.get(req_id)
        return (self.token_budget - self.given_tokens - self.kept_tokens
                + (own[0] if own is not None else 0))


@dataclass(slots=True, eq=False)
class StepLedger:
    """One step of the limiter, from ``schedule()``'s start to its end."""

    #: the step's number and its clock reading (ns)
    no: int
    now: int
    #: what the step did, reported to the observers
    report: StepReport
    #: how the step charges its users (``charges``: made with the ledger)
    #: (a ``charges.Charges``; this module imports none of it)
    charges: Any = field(init=False)
    #: the report's books, kept at hand for the charge point
    charged: dict[str, str] = field(init=False)
    refused: dict[str, int] = field(init=False)
    #: users of ``refused`` whose ready times are known when the step
    #: begins (the held tail's, ``held``): not asked again when it ends
    refused_known: dict[str, int] | None = None
    #: running requests refused at the charge point (the admission cap)
    throttled_running: int = 0
    #: active slots given at the charge point when the cap binds
    active: int = 0
    #: whether the active cap can bind (more resident than may run), and
    #: whether a decode token is charged the plain limiter's way (directly,
    #: no cap binding, no prompt budget: ``core._orl_charge``'s first case)
    capped: bool = False
    direct: bool = False
    #: throttled requests held out of ``running`` while vLLM schedules
    held: int = 0
    #: borrowers at the tail of ``running``, after the throttled requests
    lent_tail: int = 0
    #: a throttled request was preempted: admit nothing new (PRIORITY)
    block_admission: bool = False
    #: user -> its requests in ``running``, and its budget, at the step's
    #: start (counted once, when first asked)
    streams: dict[str, int] | None = None
    budgets: dict[str, int] | None = None
    #: resident slots kept for waiting requests with budget (or, with
    #: borrowing, below their user's share), and their ids
    resident_kept: int = 0
    kept_ids: set[str] = field(default_factory=frozenset)
    #: users whose first waiting request takes their next token in this step
    turns: set[str] = field(default_factory=frozenset)
    #: with borrowing, those requests (id -> user): a token set aside each
    #: (``charges.CeilingCharges.set_aside``)
    turn_ids: dict[str, str] = field(default_factory=dict)
    #: the lending step's room (None without borrowing)
    lending: LendingBook | None = None
    #: just in time, the tokens kept for the prompts of waiting requests
    #: with budget (``lending.plan_jit_room``; None: nothing kept)
    jit_room: LendingBook | None = None
    #: prompt budgets: request id -> (user, prompt tokens granted) at the
    #: charge point, and users whose prompt budget put a chunk off -> when
    #: it returns (ns; filled in when the step ends)
    prompt_charged: dict[str, tuple[str, int]] = field(default_factory=dict)
    prompt_waits: dict[str, int] = field(default_factory=dict)
    #: users one of whose waiting requests was admitted just in time (one a
    #: user a step)
    in_time: set[str] = field(default_factory=set)
    #: users a prompt was put off for just in time -> when it is in time
    #: (ns): the engine wakes then, its prompt computed by its token
    jit_waits: dict[str, int] = field(default_factory=dict)
    #: each user's output tokens its running requests may still take
    #: (``claimed_of``)
    claimed: dict[str, int] | None = None

    def __post_init__(self) -> None:
        self.charged = self.report.charged
        self.refused = self.report.refused

    def lent_now(self, request: Request) -> bool:
        """``request`` may borrow in this step (lent tokens, not charged)."""
        return request.output_rate_borrow_step == self.no

    def streams_of(self, running: list[Request]) -> dict[str, int]:
        """How many requests of ``running`` each user has, counted once in a
        step, before vLLM's ``schedule()`` (a request residency preempts is
        taken off)."""
        streams = self.streams
        if streams is None:
            streams = self.streams = streams_by_user(running)
        return streams

    def claimed_of(self, running: list[Request]) -> dict[str, int]:
        """Each user's output tokens still to come of its requests in
        ``running`` (``max_tokens`` less those sampled; a request that ends
        early frees its share sooner), counted once in a step."""
        claimed = self.claimed
        if claimed is None:
            claimed = self.claimed = {}
            for r in running:
                user = r.output_rate_user
                claimed[user] = claimed.get(user, 0) + max(0, r.max_tokens - r.num_output_tokens)
        return claimed

    def budgets_of(self, running: list[Request]) -> dict[str, int]:
        """Each user of ``running``'s budget at the step's start, asked once
        per user (nothing is charged before vLLM's ``schedule()``); not to
        be changed (copy it)."""
        budgets = self.budgets
        if budgets is None:
            left = self.charges.left
            budgets = self.budgets = {user: left(user) for user in self.streams_of(running)}
        return budgets


@dataclass(slots=True, eq=False)
class OutputRateState:
    """What the output-rate scheduler keeps across steps (the module): the
    one attribute of ours on vLLM's scheduler (``output_rate``)."""

    #: Hold throttled running requests back from vLLM's ``schedule()`` when
    #: the KV cache has room for the step (``core``); tests set False to run
    #: every step with them left at the tail of ``running``.
    hold_back: ClassVar[bool] = True
    #: Watch the limits file (and, in shared-budget mode, the store) from a
    #: thread; tests set False and call ``check()``.
    watch_thread: ClassVar[bool] = True

    #: the monotonic ns clock (tests and the twin replace it)
    clock: Callable[[], int] = monotonic_clock
    #: the limits in force (``config.OutputRateConfig``), the watcher of
    #: ``--output-rate-limits-file`` (None without one), the registered
    #: observers as one (``observers.create_observer``; None: none), told of
    #: every step, the outputs, aborts and idle waits, and the last finished
    #: step's report (``observers.StepReport``)
    config: OutputRateConfig | None = None
    watcher: Any = None
    observer: OutputRateObserver | None = None
    last_step: StepReport | None = None
    #: vLLM's active cap (``max_num_active_reqs`` as vLLM set it), its
    #: resident cap (``max_num_running_reqs``) and its token budget of a
    #: step (``max_num_scheduled_tokens``)
    base_active: int = 0
    max_running: int = 0
    token_budget: int = 0
    #: the budgets (the plain limiter or the shared one), borrowing's
    #: ceilings and counters when a limit has a ceiling, and the charges
    #: they make (``charges.choose``: set together, at start-up and when
    #: reloaded limits start or stop borrowing)
    limiter: OutputRateLimiter | None = None
    lender: Lender | None = None
    charges: Any = None
    #: shared-budget mode: leases taken up at every step boundary
    limiter_begin: Callable[[int], None] | None = None
    #: the users' prompt budgets (``prompt_budget.PromptBudgets``; None
    #: when no limit has a ``prompt_rate``), and whether the prompts of
    #: users out of output budget are computed ahead (``config.prefill_ahead``)
    prompts: Any = None
    prefill_ahead: bool = False
    #: vLLM's settings, read once
    chunked: bool = False
    prefix_caching: bool = False
    priority: bool = False
    #: vLLM's ``AsyncScheduler`` below: a request's last token may be in
    #: flight when the next step is scheduled
    is_async: bool = False
    #: KV cache groups, the block size (tokens), and the blocks a step can
    #: allocate beyond one a request (the token budget's worth of prefill)
    groups: int = 1
    block_size: int = 16
    step_blocks: int = 0
    #: the KV cache's free blocks now
    free_blocks: Callable[[], int] | None = None
    #: the KV cache manager's own ``allocate_slots`` (PRIORITY wraps it)
    upstream_allocate: Callable[..., Any] | None = None
    #: steps begun
    step_no: int = 0
    #: the engine's step period (ns; None before two busy steps) and when
    #: the last step began
    period_ns: int | None = None
    prev_now: int | None = None
    #: this step's ledger
    step: StepLedger | None = None
    #: the throttled requests the last step held back (``held``)
    held_tail: HeldTail = field(default_factory=HeldTail)

    def active_cap(self, max_running: int) -> int:
        """vLLM's admission cap of the waiting loop (``max_num_active_reqs``)
        under the resident cap ``max_running``: throttled requests don't
        count against the active cap; held-back ones (out of ``running``
        while vLLM schedules) still count against the resident cap."""
        step = self.step
        if step is None:  # (vLLM's __init__ runs)
            return min(self.base_active, max_running)
        return min(self.base_active + step.throttled_running, max_running - step.held)

    def idle_wait_s(self) -> float | None:
        """How long the engine loop may wait after a step that ran nothing:
        ``min(50 ms, earliest ready_at among users refused in the last step
        - now)``; None when no user was refused (then vLLM's own behaviour)."""
        target = self.wake_target_ns()
        if target is None:
            return None
        wait = (target - self.clock()) / 1e9
        return min(MAX_IDLE_WAIT_S, wait) if wait > 0 else 0.0

    def wake_target_ns(self) -> int | None:
        """The earliest ready_at among users refused in the last step (their
        output budget, or their prompt budget), or put off just in time."""
        step = self.step
        refused, waits, jit = step.refused, step.prompt_waits, step.jit_waits
        if not waits and not jit:
            return min(refused.values()) if refused else None
        return min([*refused.values(), *waits.values(), *jit.values()])

    def close(self) -> None:
        """The scheduler shuts down: the watcher, the observers and the
        limiter (shared-budget mode: its lease thread) stop."""
        if self.watcher is not None:
            self.watcher.close()
        observer = self.observer
        if observer is not None:
            self.observer = None
            observer.close()
        close = getattr(self.limiter, "close", None)
        if close is not None:
            close()

    def blocks_for(self, tokens: int) -> int:
        """KV blocks ``tokens`` new tokens may need: one more than they
        fill, per KV cache group."""
        return self.groups * (-(-tokens // self.block_size) + 1)

    def resident_fits(self, n_running: int, kept: int) -> bool:
        """The one resident-slot check: whether one more request fits in the
        resident set (``--max-num-seqs``) beside ``n_running`` requests in
        ``running``, those held back and ``kept`` resident slots kept for
        waiting requests (residency's, or the lending room's)."""
        return n_running + self.step.held + 1 + kept <= self.max_running

    def kv_fits(self, requests: int, tokens: int | None = None, kept_blocks: int = 0) -> bool:
        """The one KV-room check: whether the KV cache's free blocks cover a
        new block for each of ``requests`` resident requests, the blocks
        ``tokens`` new tokens may need (None: the step's whole token budget
        of prefill) and ``kept_blocks`` kept for waiting requests. Within
        it nothing the step allocates makes vLLM preempt (a failed
        allocation preempts the tail with FCFS and, with PRIORITY, by
        priority and arrival, a request already scheduled maybe)."""
        need = self.step_blocks if tokens is None else self.blocks_for(tokens)
        return self.free_blocks() >= self.groups * requests + need + kept_blocks
