"""One engine's leased slices of fleet-wide budgets (shared-budget mode).

Pure logic: imports nothing from vLLM or Redis. In shared-budget mode
(``--output-rate-shared-state``) a user's budget lives in a shared store;
each engine holds *leases*: a number of tokens the store granted it, each
lease valid until a local deadline. The engine spends only what it holds,
oldest lease first; what a lease still holds at its deadline expires.

All of it runs on the scheduler's thread: grants arrive through a deque the
lease thread appends to (``add_grant`` is called when the scheduler drains
it), deadlines are kept in a heap, and a step costs one heap look plus a
dict update per user it charged.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from itertools import count


class LeaseBook:
    """Tokens an engine may spend per user, as leases with deadlines."""

    def __init__(self) -> None:
        #: user -> tokens held over all of its live leases
        self.balance: dict[str, int] = {}
        # user -> its live leases, oldest deadline first: [deadline_ns, left]
        self._leases: dict[str, deque[list[int]]] = {}
        self._deadlines: list[tuple[int, int, str, list[int]]] = []
        self._seq = count()
        #: tokens granted, spent from leases, and expired unspent (totals)
        self.granted = 0
        self.spent = 0
        self.expired = 0

    def add_grant(self, user: str, tokens: int, deadline_ns: int) -> None:
        """A lease of ``tokens`` for ``user``, spendable until ``deadline_ns``.

        Grants of one user arrive in the order their deadlines were set, so
        each user's leases stay sorted by deadline."""
        if tokens <= 0:
            return
        lease = [deadline_ns, tokens]
        queue = self._leases.get(user)
        if queue is None:
            queue = self._leases[user] = deque()
        queue.append(lease)
        self.balance[user] = self.balance.get(user, 0) + tokens
        heapq.heappush(self._deadlines, (deadline_ns, next(self._seq), user, lease))
        self.granted += tokens

    def expire(self, now_ns: int) -> None:
        """Drop every lease whose deadline is not after ``now_ns``."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_ns:
            _, _, user, lease = heapq.heappop(deadlines)
            left = lease[1]
            if left <= 0:
                continue  # spent already, and dropped from its queue then
            lease[1] = 0
            self.expired += left
            queue = self._leases[user]
            # Oldest first: every lease before this one expired or was spent.
            queue.popleft()
            rest = self.balance[user] - left
            if rest or queue:
                self.balance[user] = rest
            else:
                del self.balance[user]
                del self._leases[user]

    def spend(self, user: str, tokens: int) -> int:
        """Spend up to ``tokens`` of the user's leases, oldest first.
        Returns how many were covered (the caller asked for no more than the
        balance, so normally all)."""
        held = self.balance.get(user, 0)
        take = tokens if tokens < held else held
        if take <= 0:
            return 0
        queue = self._leases[user]
        need = take
        while need:
            lease = queue[0]
            if lease[1] > need:
                lease[1] -= need
                break
            need -= lease[1]
            lease[1] = 0
            queue.popleft()
        if held - take:
            self.balance[user] = held - take
        else:
            del self.balance[user]
            if not queue:
                del self._leases[user]
        self.spent += take
        return take

    def clear(self) -> int:
        """Drop every lease (the store is not to be trusted any more).
        Returns the tokens dropped (counted as expired)."""
        dropped = sum(self.balance.values())
        self.expired += dropped
        self.balance.clear()
        self._leases.clear()
        for _, _, _, lease in self._deadlines:
            lease[1] = 0
        self._deadlines.clear()
        return dropped

    def clear_users(self, drop: Callable[[str], bool]) -> int:
        """Drop the leases of every user ``drop`` says (a shard of a cluster
        the engine cannot trust any more). Returns the tokens dropped
        (counted as expired)."""
        dropped = 0
        for user in [u for u in self._leases if drop(u)]:
            for lease in self._leases.pop(user):
                dropped += lease[1]
                lease[1] = 0  # (its heap entry is skipped when it comes due)
            self.balance.pop(user, None)
        self.expired += dropped
        return dropped

    def __len__(self) -> int:
        """Users holding tokens."""
        return len(self.balance)
