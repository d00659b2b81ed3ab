"""The option of shared-budget mode: its store URL and the lease protocol's times.

``--output-rate-shared-state redis://HOST:PORT[/DB]`` (or
``redis-cluster://HOST:PORT[,HOST:PORT...]``, a Redis Cluster) puts each user's
budget in a shared store (``shared_limiter`` has the mode's overview). This
module is the light part every process reads: the option's name, its URL
parser and ``SharedStateSettings``. It imports no Redis client, no threads
and nothing from vLLM, so ``config`` checks the option with it at start-up;
the store (``lease_store``), the lease thread (``lease_thread``) and the
limiter (``shared_limiter``) are built from the settings it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

SHARED_STATE_OPTION = "--output-rate-shared-state"

#: Defaults of the lease protocol (each can be set in the URL's query:
#: ``?tick_ms=50&horizon_ms=500&lookahead_ms=250&timeout_ms=250&slice_ms=0&partition_ms=30000``).
TICK_S = 0.05
HORIZON_S = 0.5
LOOKAHEAD_S = 0.25
TIMEOUT_S = 0.25
#: Long slices for users whose rate is steady (``fleet_math.LeaseSizer``):
#: off by default (0); ``slice_ms=1000`` leases such a user a second's worth
#: per ask, and widens that user's terms of the fleet bound by twice the slice.
SLICE_S = 0.0
#: The partition window ``P``: an engine cut off from the store (its calls
#: fail, its idle subscription still stands at the store) spends its fallback
#: share, which the store keeps reserved for it, until ``P`` after its last
#: answered call, then nothing until the store answers (``partition``).
PARTITION_S = 30.0

#: The least partition window (s): a cut-off engine waits up to about
#: this long before it spends (``partition``).
PARTITION_MIN_S = 2.0

#: URL schemes: one store, and a cluster (its nodes listed, comma-separated).
SINGLE_SCHEMES = ("redis", "rediss", "valkey", "valkeys")
CLUSTER_SCHEMES = ("redis-cluster", "rediss-cluster", "valkey-cluster", "valkeys-cluster")


class SharedStateError(ValueError):
    """The shared-state option has a value that cannot be used."""


@dataclass(frozen=True)
class SharedStateSettings:
    """Where the shared budgets live and the protocol's times."""

    url: str
    tick_s: float = TICK_S
    horizon_s: float = HORIZON_S
    lookahead_s: float = LOOKAHEAD_S
    timeout_s: float = TIMEOUT_S
    slice_s: float = SLICE_S
    partition_s: float = PARTITION_S
    #: a cluster's nodes to start from ((host, port), ...); empty: one store
    nodes: tuple[tuple[str, int], ...] = ()

    @property
    def cluster(self) -> bool:
        return bool(self.nodes)

    @property
    def long_horizon_s(self) -> float:
        """How long a lease may be spent after its ask was sent, at most:
        the horizon, and a long slice's length on top (``slice_ms``)."""
        return self.horizon_s + self.slice_s

    @property
    def long_lookahead_s(self) -> float:
        """How far ahead of the store's clock a granted slot may start, at
        most: the lookahead, and a long slice's length on top."""
        return self.lookahead_s + self.slice_s

    @property
    def redacted_url(self) -> str:
        """The URL without a password (for logs and metrics)."""
        parts = urlsplit(self.url)
        if self.nodes:
            return f"{parts.scheme}://" + ",".join(f"{h}:{p}" for h, p in self.nodes)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"


_QUERY_KEYS = {"tick_ms": "tick_s", "horizon_ms": "horizon_s",
               "lookahead_ms": "lookahead_s", "timeout_ms": "timeout_s", "slice_ms": "slice_s",
               "partition_ms": "partition_s"}


def parse_shared_state(value: Any) -> SharedStateSettings:
    """``redis://[:PASSWORD@]HOST:PORT[/DB][?tick_ms=..&horizon_ms=..&
    lookahead_ms=..&timeout_ms=..&slice_ms=..&partition_ms=..]`` (or ``rediss://``,
    ``valkey://``), or ``redis-cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]
    [?...]`` (or ``valkey-cluster://``): a cluster, any of its nodes."""
    if not isinstance(value, str) or not value.strip():
        raise SharedStateError(f"{SHARED_STATE_OPTION}: expected redis://HOST:PORT[/DB], got {value!r}")
    text = value.strip()
    parts = urlsplit(text)
    if parts.scheme in CLUSTER_SCHEMES:
        nodes = _cluster_nodes(text, parts.netloc, parts.path)
    elif parts.scheme in SINGLE_SCHEMES:
        nodes = ()
        _check_single(text, parts)
    else:
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: expected a redis:// (or rediss://, valkey://) URL, or "
            f"redis-cluster://HOST:PORT[,HOST:PORT...], got {_safe(text)!r}")
    settings = SharedStateSettings(text, nodes=nodes, **_query_times(parts.query))
    if settings.horizon_s < 2 * settings.tick_s:
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: horizon_ms ({settings.horizon_s * 1000:g}) must be at least "
            f"two ticks (tick_ms {settings.tick_s * 1000:g}), or leases expire before they are renewed")
    if settings.partition_s < PARTITION_MIN_S:
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: partition_ms ({settings.partition_s * 1000:g}) must be at least "
            f"{PARTITION_MIN_S * 1000:g}: a cut-off engine spends its fallback share only once the "
            f"store must have seen it silent, about 1.3 s after its calls began to fail")
    return settings


def _cluster_nodes(text: str, netloc: str, path: str) -> tuple[tuple[str, int], ...]:
    hosts = netloc.rsplit("@", 1)[-1]
    if path.strip("/"):
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: a cluster has no database number (it uses 0), got {_safe(text)!r}")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SharedStateError(
                f"{SHARED_STATE_OPTION}: each cluster node needs a host and a port "
                f"(redis-cluster://HOST:PORT[,HOST:PORT...]), got {item.strip()!r} in {_safe(text)!r}")
        nodes.append((host, int(port)))
    return tuple(nodes)


def _check_single(text: str, parts: Any) -> None:
    try:
        port = parts.port
    except ValueError:
        raise SharedStateError(f"{SHARED_STATE_OPTION}: bad port in {_safe(text)!r}") from None
    if not parts.hostname or port is None:
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: the URL needs a host and a port (redis://HOST:PORT[/DB]), got {_safe(text)!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise SharedStateError(f"{SHARED_STATE_OPTION}: the database must be a number, got {db!r}")


def _query_times(query: str) -> dict[str, float]:
    times: dict[str, float] = {}
    for key, values in parse_qs(query, keep_blank_values=True).items():
        if key not in _QUERY_KEYS:
            raise SharedStateError(
                f"{SHARED_STATE_OPTION}: unknown setting {key!r} (known: {', '.join(_QUERY_KEYS)})")
        try:
            ms = float(values[-1])
        except ValueError:
            ms = float("nan")
        if not ((ms > 0 or (ms == 0 and key == "slice_ms")) and math.isfinite(ms)):
            raise SharedStateError(
                f"{SHARED_STATE_OPTION}: {key} must be a positive number of milliseconds, got {values[-1]!r}")
        times[_QUERY_KEYS[key]] = ms / 1000
    return times


def _safe(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(parts.password, "***")
    return url
