"""An engine's alive channel: an idle subscription the store can count (shared-budget mode).

Each engine keeps one connection per store (per shard of a cluster)
subscribed to ``<heartbeat key>:alive:<engine id>`` (a sharded channel,
``SSUBSCRIBE``, in a cluster: the heartbeat key's hash tag puts it on the
shard's slot). Nothing is published on it: the lease script asks
``PUBSUB NUMSUB`` (``SHARDNUMSUB``) whether it stands, which tells an
engine killed whole (its kernel closed the socket) from one cut off from
the store (``partition``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


#: An alive channel's states, as the engine sees it.
UP = "up"
CLOSED = "closed"  # it was up, and the store closed it (or said it ended)
NONE = "none"  # never made, or given up


def alive_channel(heartbeat_key: str, engine: str) -> str:
    """The channel an engine keeps a subscriber on (the lease script names
    it the same way: ``KEYS[1] .. ':alive:' .. engine``)."""
    return f"{heartbeat_key}:alive:{engine}"


class AliveChannel:
    """One engine's idle subscription on one store (or one shard)."""

    def __init__(self, channel: str, sharded: bool = False) -> None:
        self.channel = channel
        self.sharded = sharded
        self.conn: Any = None
        self.state = NONE
        #: subscriptions made (the first, and again after each close)
        self.subscriptions = 0

    def poll(self) -> str:
        """Without blocking: has the store closed it? (Nothing is ever
        published on it: anything read is the connection's end, or the
        store saying the subscription ended.)"""
        conn = self.conn
        if conn is not None:
            try:
                if conn.can_read(timeout=0):
                    conn.read_response(push_request=True)
                    raise ConnectionError("the subscription ended")
            except Exception:
                self._drop()
                self.state = CLOSED
        return self.state

    def ensure(self, make_connection: Callable[[], Any]) -> None:
        """Subscribe, if not subscribed (called right after the store
        answered a call: it is reachable)."""
        if self.conn is not None:
            return
        conn = None
        try:
            conn = make_connection()
            conn.connect()
            conn.send_command("SSUBSCRIBE" if self.sharded else "SUBSCRIBE", self.channel)
            conn.read_response(push_request=True)  # (a push reply in RESP3)
        except Exception:  # it will be tried again after the next answered call
            if conn is not None:
                _disconnect(conn)
            return
        self.conn = conn
        self.state = UP
        self.subscriptions += 1

    def close(self) -> None:
        self._drop()
        self.state = NONE

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            _disconnect(conn)


def _disconnect(conn: Any) -> None:
    try:
        conn.disconnect()
    except Exception:  # already gone
        pass
