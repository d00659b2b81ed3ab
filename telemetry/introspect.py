"""Read-only endpoints for SREs, served by every API server from the engine
snapshots (the files the engine core writes about once a second for
``/metrics``): no call into the scheduler's thread per HTTP request, and
every API server of a ``--api-server-count N`` server answers the same.

``GET /output-rate/limits``
    The limits in force: source (the limits file or "command line"), its
    SHA-256, when it was loaded, the reload counts and last error, the
    default, tiers and listed users; ``engines`` gives each engine's digest
    and ``agree`` says whether all engines run the same limits.
``GET /output-rate/users/NAME``
    One user: effective limit and tier (and whose budget it spends, in
    ``shared`` unlisted mode), tokens charged over the last 10 s and 60 s,
    requests running, waiting and throttled, KV blocks held while
    throttled, seconds until its budget is next ready; summed over engines.
    With borrowing (a limit with a ceiling somewhere), both rates: ``limit``
    is the guaranteed rate, ``ceiling`` the ceiling (tok/s, "unlimited", or
    None: the user does not borrow), and the tokens borrowed above the
    guaranteed rate over the last 10 s and 60 s (``borrowed_10s``,
    ``borrowed_60s``; not charged, so not in ``charged_*``). With prompt
    budgets (a ``prompt_rate`` somewhere), the second policy: ``prompt_rate``
    (prompt tokens per second, "unlimited", or None: not budgeted) and
    ``prompt_ready_in_s``, seconds until its prompt budget is next ready.
``GET /output-rate/users``
    The tracked users (live requests first, then the most charged), with
    the same fields, at most ``limit`` (query, default 100).

``GET /output-rate/me``
    The caller's own user (its API key's user), as ``users/NAME`` answers.

Routes go through ``vllm_output_rate.frontend``: its middleware applies the
read rules of ``vllm_output_rate.access`` (a customer's key reads only its
own user; the list, other users and the limits need an operator key).

The same snapshots give each completion response its caller's
``RateLimit`` headers (``self_view``, registered with the front end; a
prompt budget is a second policy there): the limits the engine has in force, so a reloaded limits file shows there as
soon as the engine applies it (not when this process would have read the
file), the same on every API server; read at most once a second. Figures are as of the engine's last export
(``as_of_unix``), in export intervals of about a second.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from vllm_output_rate import frontend, settings
from vllm_output_rate.config import ANONYMOUS_USER, UNLISTED_USER
from vllm_output_rate.telemetry import collector

_COUNTS = ("charged_10s", "charged_60s", "running", "waiting", "throttled", "throttled_kv_blocks")
#: the counts added with borrowing
_BORROWED = ("borrowed_10s", "borrowed_60s")


def read_snapshots() -> list[dict[str, Any]]:
    directory = settings.get("TELEMETRY_DIR")
    return collector.read_snapshots(directory)[0] if directory else []


def limits_view(snapshots: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    engines = {str(s.get("engine")): s.get("limits") for s in snapshots if s.get("limits")}
    if not engines:
        return 503, {"error": "no engine has reported yet (starting, or telemetry is off: "
                              "OUTPUT_RATE_TELEMETRY=0)"}
    first = engines[sorted(engines)[0]]
    digests = {e: doc["sha256"] for e, doc in engines.items()}
    return 200, {**first, "engines": digests, "agree": len(set(digests.values())) == 1}


def _budget_user(limits: dict[str, Any], user: str) -> str:
    if (limits.get("unlisted_users") == "shared" and user not in limits.get("users", {})
            and user != ANONYMOUS_USER):
        return UNLISTED_USER
    return user


def _ceiling(limits: dict[str, Any], user: str) -> float | str | None:
    """A user's ceiling from the limits document: listed users' own (None:
    listed without one), the default's for the others."""
    if user in limits.get("users", {}):
        return limits["ceilings"].get(user)
    return limits.get("default_ceiling")


def user_view(snapshots: list[dict[str, Any]], user: str) -> tuple[int, dict[str, Any]]:
    status, limits = limits_view(snapshots)
    if status != 200:
        return status, limits
    budget = _budget_user(limits, user)
    out: dict[str, Any] = {
        "user": user,
        "budget_user": budget,
        "limit": limits.get("users", {}).get(budget, limits["default"]),
        "tier": limits.get("user_tiers", {}).get(budget),
        "listed": budget in limits.get("users", {}),
        "tracked": False,
        **dict.fromkeys(_COUNTS, 0),
        "ready_in_s": 0.0,
        "as_of_unix": max(s.get("users", {}).get("as_of_unix", 0) for s in snapshots),
        "limits_sha256": limits["sha256"],
    }
    borrowing = "ceilings" in limits
    if borrowing:
        out["ceiling"] = _ceiling(limits, budget)
        out.update(dict.fromkeys(_BORROWED, 0))
    prompts = "prompt_rates" in limits
    if prompts:
        out["prompt_rate"] = _prompt_rate(limits, budget)
        out["prompt_ready_in_s"] = 0.0
    for snap in snapshots:
        state = snap.get("users", {}).get("states", {}).get(budget)
        if state is None:
            continue
        out["tracked"] = True
        for key in (*_COUNTS, *_BORROWED) if borrowing else _COUNTS:
            out[key] += state.get(key, 0)
        out["ready_in_s"] = max(out["ready_in_s"], state.get("ready_in_s", 0.0))
        if prompts:
            out["prompt_ready_in_s"] = max(out["prompt_ready_in_s"],
                                           state.get("prompt_ready_in_s", 0.0))
    return 200, out


def _prompt_rate(limits: dict[str, Any], user: str) -> float | str | None:
    """A user's prompt budget from the limits document: a listed user's own
    (its tier's included), else the default's."""
    rate = limits["prompt_rates"].get(user) if user in limits.get("users", {}) else None
    return limits.get("default_prompt_rate") if rate is None else rate


def users_view(snapshots: list[dict[str, Any]], limit: int) -> tuple[int, dict[str, Any]]:
    status, limits = limits_view(snapshots)
    if status != 200:
        return status, limits
    names: dict[str, float] = {}
    for snap in snapshots:
        for user, state in snap.get("users", {}).get("states", {}).items():
            live = state.get("running", 0) + state.get("waiting", 0)
            names[user] = max(names.get(user, 0), live * 1e12 + state.get("charged_60s", 0))
    ranked = sorted(names, key=lambda u: (-names[u], u))[:limit]
    return 200, {"users": [user_view(snapshots, u)[1] for u in ranked],
                 "tracked": len(names), "limits_sha256": limits["sha256"]}


async def _limits(rest: str, query: dict[str, str]) -> tuple[int, Any]:
    return limits_view(await asyncio.to_thread(read_snapshots))


async def _users(rest: str, query: dict[str, str]) -> tuple[int, Any]:
    snapshots = await asyncio.to_thread(read_snapshots)
    if rest:
        return user_view(snapshots, rest)
    try:
        limit = max(1, min(int(query.get("limit", 100)), 1000))
    except ValueError:
        return 400, {"error": "limit: expected an integer"}
    return users_view(snapshots, limit)


#: how long the RateLimit headers reuse one read of the snapshots (the
#: engine exports about once a second)
SELF_VIEW_TTL_S = 1.0
_cached: tuple[float, list[dict[str, Any]]] = (float("-inf"), [])


async def self_view(user: str) -> dict[str, Any] | None:
    """``user``'s own budget for its RateLimit headers (None: no engine
    has reported yet)."""
    global _cached
    if time.monotonic() - _cached[0] >= SELF_VIEW_TTL_S:
        _cached = (time.monotonic(), await asyncio.to_thread(read_snapshots))
    status, view = user_view(_cached[1], user)
    return view if status == 200 else None


def register() -> None:
    frontend.register_route("limits", _limits)
    frontend.register_route("users", _users)
    frontend.register_self_view(self_view)
