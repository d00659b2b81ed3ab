"""What the what-if twin measures while it runs, and what it writes:
``summary.json`` (``SUMMARY_SCHEMA``, versioned) and ``report.md``.

Everything is in virtual time (the twin's clock, ns). Per user:

* ``requests``, ``finished``, ``output_tokens``;
* ``rate_tok_s``: tokens per second from the user's first token to its last
  (the first step's tokens open the span and are not counted in it);
* ``ttft_s``: arrival to first token, p50/p90/p99 over the user's requests;
* ``itl_s``: spacing between consecutive tokens of each request (a step
  with k tokens of a request adds one spacing and k - 1 zeros), p50/p90/p99;
* ``throttled_s``: virtual seconds with at least one of its requests
  throttled (skipped for lack of budget while resident), and
  ``throttled_request_s`` the same summed over its requests;
* ``kv_blocks_throttled``: KV blocks its throttled requests held, the most
  at any step (``max``) and the mean over ``throttled_s`` (``mean``), read
  from the KV cache manager at every step (``kv_block_s`` their integral);
* ``borrowed_tokens``: of its output tokens, those lent above its
  guaranteed rate (a limit with a ceiling); ``refused``: its requests
  refused in front of the engine (a gate given to the twin: the fairness
  benchmark's gateway arm).

Quantiles interpolate linearly (``tools.common.stats.quantile``); null when a user
has no such sample. The samples are kept exactly: TTFTs as 8-byte integers
(``array``, one a request), spacings as value -> count
(``tools.common.stats.CountedSamples``: a long run's millions of spacings take a
few distinct values); a finished request's state is dropped. A long run's
memory grows with neither.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.internals import kv_blocks_held
from vllm_output_rate.tools.common.stats import CountedSamples, quantile

SCHEMA = 1
NS = 1_000_000_000
#: The plots' time buckets (virtual ns).
BUCKET_NS = NS
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

_QUANTILES_OBJ = {"type": ["object"], "properties": {
    q: {"type": ["number", "null"]} for q, _ in QUANTILES}}
SUMMARY_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "vllm-output-rate twin summary",
    "type": "object",
    "required": ["schema", "run", "users"],
    "properties": {
        "schema": {"const": SCHEMA},
        "run": {"type": "object", "description": "the run's facts", "properties": {
            "scheduler": {"type": "string", "description": "the scheduler class run"},
            "upstream_scheduler": {"type": "boolean"},
            "vllm_version": {"type": "string"},
            "async_scheduling": {"type": "boolean"},
            "limits": {"type": ["object", "null"],
                       "description": "default and per-user tok/s at the start (null: none)"},
            "limits_changes": {"type": "array", "items": {"type": "object", "properties": {
                "t": {"type": "number"}, "in_force_t": {"type": ["number", "null"]},
                "result": {"type": ["string", "null"]}}}},
            "step_time": {"type": "object", "description": "the step-time model, with "
                          "is_estimate true when it is not a measurement"},
            "virtual_s": {"type": "number"}, "wall_s": {"type": "number"},
            "until_s": {"type": ["number", "null"], "description": "--until: the virtual "
                        "second the run was cut at (null: it ran until every request finished)"},
            "steps": {"type": "integer"}, "model_steps": {"type": "integer"},
            "requests": {"type": "integer"}, "seed": {"type": "integer"},
            "num_gpu_blocks": {"type": "integer"}, "options": {"type": "object"}}},
        "users": {"type": "object", "additionalProperties": {"type": "object", "properties": {
            "requests": {"type": "integer"}, "finished": {"type": "integer"},
            "unstarted": {"type": "integer", "description": "requests without a first token "
                          "when the run ended (cut by --until; not in ttft_s)"},
            "output_tokens": {"type": "integer"},
            "rate_tok_s": {"type": ["number", "null"]},
            "ttft_s": _QUANTILES_OBJ, "itl_s": _QUANTILES_OBJ,
            "throttled_s": {"type": "number"}, "throttled_request_s": {"type": "number"},
            "kv_blocks_throttled": {"type": "object", "properties": {
                "max": {"type": "integer"}, "mean": {"type": ["number", "null"]}}},
            "kv_block_s": {"type": "number"},
            "borrowed_tokens": {"type": "integer", "description": "of output_tokens, those "
                                "lent above the user's guaranteed rate (borrowing)"},
            "refused": {"type": "integer", "description": "requests refused in front of the "
                        "engine (a gateway's limit: the fairness benchmark's gateway arm)"}}}},
        "files": {"type": "object", "description": "the other outputs, relative to --out"},
        "plots": {"type": "object", "description": "the report's plots (rate, ttft, "
                  "kv_throttled: PNG files relative to --out); absent with --no-plots"},
    },
}


@dataclass
class _User:
    requests: int = 0
    finished: int = 0
    tokens: int = 0
    first_ns: int | None = None
    first_n: int = 0
    last_ns: int = 0
    ttft_ns: array = field(default_factory=lambda: array("q"))
    itl_ns: CountedSamples = field(default_factory=CountedSamples)
    throttled_ns: int = 0
    throttled_req_ns: int = 0
    kv_block_ns: int = 0
    kv_max: int = 0
    borrowed: int = 0
    refused: int = 0


class TwinStats:
    """Folds the twin's arrivals, steps and outputs into per-user figures."""

    def __init__(self, scheduler: Any, keep_charges: bool = False, t0_ns: int = 0) -> None:
        self._kv = scheduler.kv_cache_manager
        self.users: dict[str, _User] = defaultdict(_User)
        #: request id -> [user, arrival ns, last token ns or None] (finished
        #: ones too: with async scheduling a step may still list one)
        self._reqs: dict[str, list] = {}
        #: the requests finished in each of the last updates (``on_update``)
        self._done: list[list[str]] = []
        #: (step ns, {user: (throttled requests, kv blocks)}) of the last step
        self._thr: tuple[int, dict[str, tuple[int, int]]] | None = None
        #: (ns, user, tokens charged) per step and user, when kept (tests)
        self.charges: list[tuple[int, str, int]] | None = [] if keep_charges else None
        #: for the plots, per virtual second (index from the clock's start):
        #: user -> {second: tokens}, user -> {second: KV block-ns held throttled}
        self.t0_ns = t0_ns
        self.tokens_by_s: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.kv_by_s: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        #: when the run ended (``finish``)
        self.end_ns = t0_ns
        #: user -> {second: tokens borrowed}
        self.borrowed_by_s: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        #: set to a dict to keep, per user, each finished request's
        #: (arrival, finish) ns (the fairness benchmark; grows with the run)
        self.spans: dict[str, list[tuple[int, int]]] | None = None

    def on_arrival(self, req_id: str, user: str, now_ns: int) -> None:
        self._reqs[req_id] = [user, now_ns, None]
        self.users[user].requests += 1

    def on_refused(self, user: str) -> None:
        """A request refused before the engine (a gateway in front)."""
        self.users[user].refused += 1

    def on_step(self, record: Any) -> None:
        """One scheduler step's ``StepReport`` (output-rate schedulers only)."""
        now = record.now_ns
        self._close_throttled(now)
        if record.borrowed:
            users, by_s = self.users, self.borrowed_by_s
            second = (now - self.t0_ns) // BUCKET_NS
            for user in record.borrowed.values():
                users[user].borrowed += 1
                by_s[user][second] += 1
        if self.charges is not None and record.charged:
            self.charges.extend((now, u, n) for u, n in record.charged_by_user.items())
        if record.throttled:
            by_user: dict[str, list[int]] = {}
            reqs, kv = self._reqs, self._kv
            for req_id in record.throttled:
                counts = by_user.setdefault(reqs[req_id][0], [0, 0])
                counts[0] += 1
                counts[1] += kv_blocks_held(kv, req_id)
            self._thr = (now, {u: (c[0], c[1]) for u, c in by_user.items()})

    def _close_throttled(self, now: int) -> None:
        if self._thr is None:
            return
        since, by_user = self._thr
        self._thr = None
        dt = now - since
        t0 = self.t0_ns
        for user, (n, blocks) in by_user.items():
            u = self.users[user]
            u.throttled_ns += dt
            u.throttled_req_ns += n * dt
            u.kv_block_ns += blocks * dt
            u.kv_max = max(u.kv_max, blocks)
            if blocks:  # the interval's block-ns, split over the seconds it spans
                buckets = self.kv_by_s[user]
                start = since
                while start < now:
                    second = (start - t0) // BUCKET_NS
                    end = min(now, t0 + (second + 1) * BUCKET_NS)
                    buckets[second] += blocks * (end - start)
                    start = end

    def on_update(self, engine_outputs: Any, now: int) -> None:
        """The engine outputs of one ``update_from_output``, at ``now``."""
        reqs, users = self._reqs, self.users
        finished: list[str] = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                k = len(o.new_token_ids)
                state = reqs.get(o.request_id)
                if state is None:
                    continue
                u = users[state[0]]
                if k:
                    if state[2] is None:
                        u.ttft_ns.append(now - state[1])
                    else:
                        u.itl_ns.append(now - state[2])
                    if k > 1:
                        u.itl_ns.add(0, k - 1)
                    state[2] = now
                    u.tokens += k
                    self.tokens_by_s[state[0]][(now - self.t0_ns) // BUCKET_NS] += k
                    if u.first_ns is None:
                        u.first_ns = now
                    if now == u.first_ns:
                        u.first_n += k
                    u.last_ns = now
                if o.finish_reason is not None:
                    u.finished += 1
                    finished.append(o.request_id)
                    if self.spans is not None:
                        self.spans.setdefault(state[0], []).append((state[1], now))
        # a request that finished two updates ago is in no later output
        # (async scheduling may list one once more): its state goes, so that
        # a long run's memory does not grow with the requests it has seen
        done = self._done
        done.append(finished)
        if len(done) > 2:
            for req_id in done.pop(0):
                reqs.pop(req_id, None)

    def finish(self, end_ns: int) -> None:
        self._close_throttled(end_ns)
        self.end_ns = end_ns

    def unfinished(self) -> list[tuple[str, int]]:
        """(user, arrival ns) of each request not finished when the run
        ended."""
        done = {req_id for batch in self._done for req_id in batch}
        return [(user, arrival) for req_id, (user, arrival, _) in self._reqs.items()
                if req_id not in done]

    def unstarted_waits(self) -> dict[str, list[int]]:
        """Per user, how long each request without a first token had
        waited when the run ended (ns; a run cut by ``--until``)."""
        out: dict[str, list[int]] = defaultdict(list)
        for user, arrival, last in self._reqs.values():
            if last is None:
                out[user].append(self.end_ns - arrival)
        return dict(out)

    def timeline(self) -> dict[str, Any]:
        """What the plots draw: per user its tok/s and mean KV blocks held
        throttled per virtual second, and its TTFTs (s)."""
        def series(by_s: dict[int, int], scale: float) -> list[float]:
            if not by_s:
                return []
            return [by_s.get(i, 0) * scale for i in range(max(by_s) + 1)]

        return {"bucket_s": BUCKET_NS / NS,
                "rate": {u: series(b, NS / BUCKET_NS) for u, b in self.tokens_by_s.items()},
                "kv_throttled": {u: series(b, 1 / BUCKET_NS) for u, b in self.kv_by_s.items()},
                "ttft_s": {u: [x / NS for x in v.ttft_ns] for u, v in self.users.items()}}

    def user_summary(self) -> dict[str, dict[str, Any]]:
        def qs(values_ns: Any) -> dict[str, float | None]:
            at = values_ns.quantile if isinstance(values_ns, CountedSamples) else (
                lambda q: quantile(values_ns, q))
            return {name: (round(at(q) / NS, 6) if len(values_ns) else None)
                    for name, q in QUANTILES}

        out = {}
        unstarted = {u: len(w) for u, w in self.unstarted_waits().items()}
        for user in sorted(self.users):
            u = self.users[user]
            span = u.last_ns - (u.first_ns or 0)
            rate = (u.tokens - u.first_n) / (span / NS) if u.first_ns is not None and span else None
            out[user] = {
                "requests": u.requests, "finished": u.finished,
                "unstarted": unstarted.get(user, 0), "output_tokens": u.tokens,
                "rate_tok_s": None if rate is None else round(rate, 4),
                "ttft_s": qs(u.ttft_ns), "itl_s": qs(u.itl_ns),
                "throttled_s": round(u.throttled_ns / NS, 6),
                "throttled_request_s": round(u.throttled_req_ns / NS, 6),
                "kv_blocks_throttled": {
                    "max": u.kv_max,
                    "mean": round(u.kv_block_ns / u.throttled_ns, 3) if u.throttled_ns else None},
                "kv_block_s": round(u.kv_block_ns / NS, 6),
                "borrowed_tokens": u.borrowed, "refused": u.refused,
            }
        return out


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def render_report(summary: dict[str, Any]) -> str:
    """``report.md``: the run's facts and one table of the users."""
    run = summary["run"]
    st = run["step_time"]
    lines = [
        "# What-if twin run", "",
        f"- scheduler: `{run['scheduler']}` (vLLM {run['vllm_version']}, "
        f"{'async' if run['async_scheduling'] else 'sync'} scheduling)",
        f"- workload: `{run['workload']}`: {run['requests']} requests; "
        f"{run['virtual_s']:.1f} virtual s in {run['wall_s']:.1f} wall s "
        f"({run['virtual_s'] / max(run['wall_s'], 1e-9):.1f}x), {run['steps']} steps",
        f"- step time: {st['kind']}, base {st['base_s'] * 1e3:g} ms, "
        f"per decode {st['per_decode_s'] * 1e3:g} ms, per prefill token "
        f"{st['per_prefill_token_s'] * 1e3:g} ms, per context token "
        f"{st['per_context_token_s'] * 1e3:g} ms; source: {st['source']}"
        + (" — **an estimate, not a measurement of any engine: figures in time are "
           "only as good as it**" if st["is_estimate"] else ""),
    ]
    limits = run["limits"]
    if limits is None:
        lines.append("- limits: none (vLLM's own scheduler)")
    else:
        users = ", ".join(f"{u} {r:g}" for u, r in sorted(limits["users"].items())) or "none"
        lines.append(f"- limits (tok/s): default {limits['default']:g}; users: {users}")
    for change in run["limits_changes"]:
        lines.append(f"- limits file replaced at t={change['t']:g} s: {change['result']}, "
                     f"in force at t={_fmt(change['in_force_t'], 1, 3)} s")
    lines += ["", "| user | requests | tokens | rate tok/s | TTFT p50 / p90 / p99 ms | "
              "spacing p50 / p90 / p99 ms | throttled s | KV blocks throttled max / mean |",
              "|---|---:|---:|---:|---|---|---:|---|"]
    for user, u in summary["users"].items():
        ttft = " / ".join(_fmt(u["ttft_s"][q], 1e3) for q, _ in QUANTILES)
        itl = " / ".join(_fmt(u["itl_s"][q], 1e3) for q, _ in QUANTILES)
        kv = u["kv_blocks_throttled"]
        lines.append(f"| {user} | {u['requests']} | {u['output_tokens']} | "
                     f"{_fmt(u['rate_tok_s'], 1, 2)} | {ttft} | {itl} | "
                     f"{u['throttled_s']:.2f} | {kv['max']} / {_fmt(kv['mean'])} |")
    plots = summary.get("plots") or {}
    for title, key in (("Per-user rate", "rate"), ("TTFT per user", "ttft"),
                       ("KV blocks held by throttled requests", "kv_throttled")):
        if plots.get(key):
            lines += ["", f"![{title}]({plots[key]})"]
    files = summary.get("files", {})
    if files:
        lines += ["", "Files: " + ", ".join(f"`{name}`" for name in files.values() if name)]
    return "\n".join(lines) + "\n"
