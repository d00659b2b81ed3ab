"""The one table of every metric this project exports.

Code, dashboards and alert rules read names, types, units, help texts and
buckets from here; nothing else spells a metric name. Names follow the
Prometheus naming guide (unit last, ``_total`` on counters, ``_ratio`` for
shares of 1) under one prefix, ``vllm_output_rate_``, that sorts right
after vLLM's own ``vllm:`` series. (It must not start with ``vllm:``:
vLLM's ``unregister_vllm_metrics()`` removes collectors named so.) The
names before 0.1.0's rename are in ``RENAMED_FROM`` (and the README).

Every metric also carries vLLM's own ``model_name`` and ``engine`` labels.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "vllm_output_rate_"
ENGINE_LABELS = ("model_name", "engine")

#: Inter-token spacing: vLLM's own ITL buckets, with finer steps below 10 ms
#: so that a 100 tok/s limit (10 ms) and a fast CPU step are told apart.
SPACING_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
#: How late the engine loop woke after the ready time it waited for.
LATENESS_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
#: How long one idle wait lasted (capped at 50 ms by design).
IDLE_WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.1)
#: How long one request stayed throttled (skipped step after step).
EPISODE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: One call of the lease thread to the shared store (shared-budget mode).
STORE_CALL_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: The limiter's share of one schedule() call (0..1).
SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Metric:
    """One exported metric."""

    name: str  # without PREFIX; counters without the _total suffix
    kind: str  # "counter" | "gauge" | "histogram"
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    #: whether it had another name before 0.1.0's rename (False: added after it)
    renamed: bool = True
    #: exported only in this mode ("shared_state": --output-rate-shared-state)
    only_in: str | None = None

    @property
    def full_name(self) -> str:
        """The name as scraped (counters get ``_total``)."""
        base = PREFIX + self.name
        return base + "_total" if self.kind == "counter" else base

    @property
    def all_labels(self) -> tuple[str, ...]:
        return ENGINE_LABELS + self.labels

    def key(self, *labels: str) -> tuple[str, tuple[str, ...]]:
        """The key of its series with the values of ``labels`` (in the
        order of ``self.labels``), as the telemetry's series and snapshots
        keep it."""
        return (self.name, labels)


METRICS: tuple[Metric, ...] = (
    Metric("tokens_charged", "counter", "tokens",
           "Output tokens charged to a user when a sampling step was dispatched (net of refunds).",
           ("user",)),
    Metric("engine_tokens_charged", "counter", "tokens",
           "Output tokens charged to all users (exact total, no label cap)."),
    Metric("tokens_borrowed", "counter", "tokens",
           "Output tokens lent to a user over its guaranteed rate, under its ceiling, from "
           "capacity nobody within its guaranteed rate used (not in tokens_charged).",
           ("user",), renamed=False, only_in="borrowing"),
    Metric("engine_tokens_borrowed", "counter", "tokens",
           "Output tokens lent to all users (exact total); over tokens charged plus borrowed: "
           "the share of the engine's tokens that were borrowed.", renamed=False, only_in="borrowing"),
    Metric("tokens_refunded", "counter", "tokens",
           "Charged tokens given back because the request was not dispatched.",
           ("user", "reason")),
    Metric("engine_tokens_refunded", "counter", "tokens",
           "Tokens refunded for all users (exact total)."),
    Metric("requests_skipped", "counter", "requests",
           "Running requests skipped in a step because their user had no budget (one per request per step).",
           ("user",)),
    Metric("engine_requests_skipped", "counter", "requests",
           "Running requests skipped for lack of budget, all users (exact total)."),
    Metric("engine_throttled_preempted", "counter", "requests",
           "Requests out of budget (throttled, or lent tokens) preempted in place of a request "
           "with budget: for KV blocks (reason kv_cache, --scheduling-policy priority; FCFS "
           "preempts the tail of running, where they sit) or for a resident slot (reason "
           "resident_slot: every slot held, some by a user with more streams than its budget and rate keep busy).",
           ("reason",), renamed=False),
    Metric("prompt_tokens_computed", "counter", "tokens",
           "Prompt tokens a user's prefill chunks computed (every user, with or without a prompt "
           "budget; prefix-cache hits are not computed, a prompt computed again after a "
           "preemption is).", ("user",), renamed=False),
    Metric("engine_prompt_tokens_computed", "counter", "tokens",
           "Prompt tokens computed for all users (exact total, no label cap).", renamed=False),
    Metric("prompt_tokens_deferred", "counter", "tokens",
           "Prompt tokens put off: a request's prompt counted once per reason, when first put "
           "off, with the tokens it had left to compute; reason prompt_budget (its user's "
           "prompt_rate) or just_in_time (its user out of output budget: not computed before its "
           "first token may be sampled).", ("user", "reason"), renamed=False),
    Metric("engine_prompt_tokens_deferred", "counter", "tokens",
           "Prompt tokens put off, all users (exact total), by reason.", ("reason",),
           renamed=False),
    Metric("prompt_step_seconds", "counter", "seconds",
           "Seconds of engine steps a user's prompt work took: each step's measured time split by "
           "the step-time model (OUTPUT_RATE_STEP_TIME, else a built-in estimate) between the "
           "step's fixed cost, its decodes and each user's prompt tokens; over "
           "engine_step_seconds, the share of step time that user's prompts took.",
           ("user",), renamed=False),
    Metric("engine_step_seconds", "counter", "seconds",
           "Measured time of the engine's steps that computed anything (from a step's start to "
           "the next one's; idle waits left out).", renamed=False),
    Metric("throttled_requests", "gauge", "requests",
           "Requests throttled in the last step (resident, holding KV, not running).",
           ("user",)),
    Metric("throttled_kv_blocks", "gauge", "blocks",
           "KV cache blocks held by requests throttled in the last step.", ("user",)),
    Metric("engine_throttled_requests", "gauge", "requests",
           "Requests throttled in the last step, all users."),
    Metric("engine_throttled_kv_blocks", "gauge", "blocks",
           "KV cache blocks held by throttled requests, all users."),
    Metric("throttled_kv_cache_ratio", "gauge", "ratio",
           "Share of the KV cache (0..1) held by throttled requests."),
    Metric("user_limit_tokens_per_second", "gauge", "tokens per second",
           "Configured output-token limit of each labelled user.", ("user",)),
    Metric("default_limit_tokens_per_second", "gauge", "tokens per second",
           "Configured limit of users without an override."),
    Metric("inter_token_seconds", "histogram", "seconds",
           "Engine-side spacing between consecutive output tokens of a request, by user.",
           ("user",), SPACING_BUCKETS),
    Metric("engine_inter_token_seconds", "histogram", "seconds",
           "Engine-side spacing between consecutive output tokens of a request, all users.",
           (), SPACING_BUCKETS),
    Metric("throttle_episode_seconds", "histogram", "seconds",
           "Duration of one throttle episode of a request: from the first step it was skipped "
           "to its last dispatch before a step that did not skip it (or its abort), by user; "
           "a request pacing at its limit (a token, then skipped again) has one episode over "
           "its pacing, not one per token.",
           ("user",), EPISODE_BUCKETS),
    Metric("wake_lateness_seconds", "histogram", "seconds",
           "How late the engine loop woke after the ready time it waited for.",
           (), LATENESS_BUCKETS),
    Metric("idle_wait_seconds", "histogram", "seconds",
           "Idle waits of the engine loop while only throttled work remained, by what ended them.",
           ("reason",), IDLE_WAIT_BUCKETS),
    Metric("schedule_limiter_ratio", "histogram", "ratio",
           "Share of each schedule() call spent in the limiter's own code.",
           (), SHARE_BUCKETS),
    Metric("telemetry_snapshot_timestamp_seconds", "gauge", "seconds",
           "Unix time at which the engine core wrote the snapshot this scrape shows "
           "(falls behind time() when the engine's exporter stops)."),
    Metric("limits_reloads", "counter", "reloads",
           "Looks at the limits file that found it changed (or were asked by SIGHUP), by result: "
           "loaded (new limits in force), unchanged (same content), invalid (refused, the limits "
           "in force stay), unreadable.", ("result",)),
    Metric("limits_loaded_timestamp_seconds", "gauge", "seconds",
           "Unix time at which the limits in force were loaded."),
    Metric("limits_info", "gauge", "info",
           "1, labelled with the SHA-256 of the limits in force and where they come from "
           "(the limits file, or the command line).", ("sha256", "source")),
    # Shared-budget mode (--output-rate-shared-state): per engine, no user
    # label; kind: the budget (rate, ceiling, prompt), a user's output rate,
    # its ceiling or its prompt budget.
    Metric("shared_tokens_leased", "counter", "tokens",
           "Tokens the shared store granted this engine as leases (shared-budget mode), by kind "
           "of budget (rate, ceiling, prompt).", ("kind",), renamed=False, only_in="shared_state"),
    Metric("shared_tokens_spent", "counter", "tokens",
           "Leased tokens this engine spent, by kind of budget.", ("kind",), renamed=False,
           only_in="shared_state"),
    Metric("shared_tokens_expired", "counter", "tokens",
           "Leased tokens that expired unspent (given back to no one: the store's slots pass), "
           "by kind of budget.", ("kind",), renamed=False, only_in="shared_state"),
    Metric("shared_tokens_unleased", "counter", "tokens",
           "Tokens spent in fallback, without a lease (the store unreachable), by kind of budget.",
           ("kind",), renamed=False, only_in="shared_state"),
    Metric("shared_store_calls", "counter", "calls",
           "Calls of this engine's lease thread to the shared store, by result (ok, failed).",
           ("result",), renamed=False, only_in="shared_state"),
    Metric("shared_store_entries", "counter", "entries",
           "Budget entries (one user's budget of one kind) this engine's lease thread asked the "
           "shared store for, by kind of budget (rate, ceiling, prompt) and result (ok: in a call "
           "answered; failed: in a call that failed or timed out).", ("kind", "result"),
           renamed=False, only_in="shared_state"),
    Metric("shared_store_call_seconds", "histogram", "seconds",
           "Duration of one successful lease call to the shared store (off the scheduler's thread).",
           (), STORE_CALL_BUCKETS, renamed=False, only_in="shared_state"),
    Metric("shared_store_fallback", "gauge", "state",
           "1 while this engine is in fallback (the shared store unreachable: each user gets its "
           "limit divided by the engines last seen sharing it), else 0.", renamed=False, only_in="shared_state"),
    Metric("shared_store_partitioned", "gauge", "state",
           "1 while this engine is in fallback with its alive channel standing at the shared store "
           "(cut off, not the store down: the store keeps its fallback share reserved, and it "
           "spends nothing once the partition window has passed), else 0.", renamed=False,
           only_in="shared_state"),
    Metric("shared_store_fallback_seconds", "counter", "seconds",
           "Time this engine spent in fallback.", renamed=False, only_in="shared_state"),
    Metric("shared_store_resets", "counter", "resets",
           "Times this engine found the shared store had lost its data (restarted empty).", renamed=False, only_in="shared_state"),
    Metric("shared_live_engines", "gauge", "engines",
           "Engines the shared store last counted as live (heartbeats within 2 s).", renamed=False, only_in="shared_state"),
    Metric("state_entries", "gauge", "entries",
           "Entries held by the project's own per-request and per-user state in the engine core, "
           "by container (requests.*: empty when nothing is live; users.*, labels and series: "
           "bounded by the label cap; limiter.users: users whose budget is not full).",
           ("container",), renamed=False),
    Metric("telemetry_dropped", "counter", "events",
           "Telemetry data dropped (export failed, event log write failed, event queue full, "
           "a fold failed, trace queue full, trace export failed), by reason.", ("reason",)),
)

BY_NAME = {m.name: m for m in METRICS}

# Each metric as the code refers to it (its short name in capitals): no
# module but this one spells a metric's name (tests/test_metric_names.py).
TOKENS_CHARGED = BY_NAME["tokens_charged"]
ENGINE_TOKENS_CHARGED = BY_NAME["engine_tokens_charged"]
TOKENS_BORROWED = BY_NAME["tokens_borrowed"]
ENGINE_TOKENS_BORROWED = BY_NAME["engine_tokens_borrowed"]
TOKENS_REFUNDED = BY_NAME["tokens_refunded"]
ENGINE_TOKENS_REFUNDED = BY_NAME["engine_tokens_refunded"]
REQUESTS_SKIPPED = BY_NAME["requests_skipped"]
ENGINE_REQUESTS_SKIPPED = BY_NAME["engine_requests_skipped"]
ENGINE_THROTTLED_PREEMPTED = BY_NAME["engine_throttled_preempted"]
PROMPT_TOKENS_COMPUTED = BY_NAME["prompt_tokens_computed"]
ENGINE_PROMPT_TOKENS_COMPUTED = BY_NAME["engine_prompt_tokens_computed"]
PROMPT_TOKENS_DEFERRED = BY_NAME["prompt_tokens_deferred"]
ENGINE_PROMPT_TOKENS_DEFERRED = BY_NAME["engine_prompt_tokens_deferred"]
PROMPT_STEP_SECONDS = BY_NAME["prompt_step_seconds"]
ENGINE_STEP_SECONDS = BY_NAME["engine_step_seconds"]
THROTTLED_REQUESTS = BY_NAME["throttled_requests"]
THROTTLED_KV_BLOCKS = BY_NAME["throttled_kv_blocks"]
ENGINE_THROTTLED_REQUESTS = BY_NAME["engine_throttled_requests"]
ENGINE_THROTTLED_KV_BLOCKS = BY_NAME["engine_throttled_kv_blocks"]
THROTTLED_KV_CACHE_RATIO = BY_NAME["throttled_kv_cache_ratio"]
USER_LIMIT_TOKENS_PER_SECOND = BY_NAME["user_limit_tokens_per_second"]
DEFAULT_LIMIT_TOKENS_PER_SECOND = BY_NAME["default_limit_tokens_per_second"]
INTER_TOKEN_SECONDS = BY_NAME["inter_token_seconds"]
ENGINE_INTER_TOKEN_SECONDS = BY_NAME["engine_inter_token_seconds"]
THROTTLE_EPISODE_SECONDS = BY_NAME["throttle_episode_seconds"]
WAKE_LATENESS_SECONDS = BY_NAME["wake_lateness_seconds"]
IDLE_WAIT_SECONDS = BY_NAME["idle_wait_seconds"]
SCHEDULE_LIMITER_RATIO = BY_NAME["schedule_limiter_ratio"]
TELEMETRY_SNAPSHOT_TIMESTAMP_SECONDS = BY_NAME["telemetry_snapshot_timestamp_seconds"]
LIMITS_RELOADS = BY_NAME["limits_reloads"]
LIMITS_LOADED_TIMESTAMP_SECONDS = BY_NAME["limits_loaded_timestamp_seconds"]
LIMITS_INFO = BY_NAME["limits_info"]
SHARED_TOKENS_LEASED = BY_NAME["shared_tokens_leased"]
SHARED_TOKENS_SPENT = BY_NAME["shared_tokens_spent"]
SHARED_TOKENS_EXPIRED = BY_NAME["shared_tokens_expired"]
SHARED_TOKENS_UNLEASED = BY_NAME["shared_tokens_unleased"]
SHARED_STORE_CALLS = BY_NAME["shared_store_calls"]
SHARED_STORE_ENTRIES = BY_NAME["shared_store_entries"]
SHARED_STORE_CALL_SECONDS = BY_NAME["shared_store_call_seconds"]
SHARED_STORE_FALLBACK = BY_NAME["shared_store_fallback"]
SHARED_STORE_FALLBACK_SECONDS = BY_NAME["shared_store_fallback_seconds"]
SHARED_STORE_RESETS = BY_NAME["shared_store_resets"]
SHARED_LIVE_ENGINES = BY_NAME["shared_live_engines"]
SHARED_STORE_PARTITIONED = BY_NAME["shared_store_partitioned"]
STATE_ENTRIES = BY_NAME["state_entries"]
TELEMETRY_DROPPED = BY_NAME["telemetry_dropped"]

#: Scraped name now -> the name it had before the rename (prefix
#: ``output_rate_``; the two shares were ``_share``).
_OLD_SHORT = {"throttled_kv_cache_ratio": "throttled_kv_cache_share",
              "schedule_limiter_ratio": "schedule_limiter_share"}
RENAMED_FROM = {
    m.full_name: "output_rate_" + _OLD_SHORT.get(m.name, m.name)
    + ("_total" if m.kind == "counter" else "")
    for m in METRICS if m.renamed
}


def metric(name: str) -> Metric:
    """Look a metric up by its short name (raises KeyError when unknown)."""
    return BY_NAME[name]


#: The series a histogram exposes, after its family name.
HISTOGRAM_SERIES = ("bucket", "count", "sum")


def series_name(name: str, part: str | None = None) -> str:
    """The name a series of metric ``name`` (its short name) has on
    ``/metrics``, as ``telemetry.collector`` exposes it: a counter's with
    ``_total``, a gauge's as is, a histogram's ``_bucket``, ``_count`` or
    ``_sum`` series (``part``: one of HISTOGRAM_SERIES, required for a
    histogram, refused for the others). Raises KeyError for an unknown
    metric, ValueError for a wrong ``part``."""
    m = BY_NAME[name]
    if m.kind == "histogram":
        if part not in HISTOGRAM_SERIES:
            raise ValueError(f"{m.full_name} is a histogram: part must be one of "
                             f"{', '.join(HISTOGRAM_SERIES)}, not {part!r}")
        return f"{m.full_name}_{part}"
    if part is not None:
        raise ValueError(f"{m.full_name} is a {m.kind}: it has no {part!r} series")
    return m.full_name
