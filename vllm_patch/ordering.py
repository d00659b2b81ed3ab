"""The order the scheduler puts requests in: pure functions over requests.

Read by ``scheduler`` before vLLM's ``schedule()`` runs (rotation, and the
user served longest ago first when the active cap binds) and, with
``--scheduling-policy priority``, when vLLM needs KV blocks (which throttled
request to preempt). They read the attributes the scheduler keeps on each
request (``output_rate_user``, ``output_rate_served_ns``) and vLLM's own
(``priority``, ``arrival_time``, ``request_id``); they change nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from operator import attrgetter
from typing import Any


def streams_by_user(requests: Any) -> dict[str, int]:
    """How many of ``requests`` each user has (counted in C), users in the
    order of their first request."""
    return dict(Counter(map(_user, requests)))


_user = attrgetter("output_rate_user")


def beyond_resident(waiting: Iterable[Any], left: Callable[[str], int],
                    resident: Mapping[str, int]) -> Iterator[tuple[Any, int, bool]]:
    """Each of ``waiting``, in queue order, with its user's budget beyond
    what the user's resident streams and its waiting requests before it
    take (``left(user)``, asked once per user when first met, less
    ``resident[user]``, less one a request before it): above 0, the request
    is within its user's budget in this step; and whether it is its user's
    first. Lazy: a user's budget is asked only when one of its requests is
    reached."""
    wanted: dict[str, int] = {}
    for request in waiting:
        user = request.output_rate_user
        n = wanted.get(user)
        first = n is None
        if first:
            n = left(user) - resident.get(user, 0)
        wanted[user] = n - 1
        yield request, n, first


def last_token_in_flight(request: Any) -> bool:
    """Async scheduling: the request's last token is in flight, and vLLM's
    ``schedule()`` passes it by (vLLM's own test, the same in 0.32 to 0.34).
    It waits for no budget: it takes none and is not throttled."""
    return bool(request.num_output_placeholders) and (
        request.num_computed_tokens + 2 - request.num_output_placeholders
        >= request.num_prompt_tokens + request.max_tokens)


def rotated(running: list[Any]) -> list[Any]:
    """``running`` with each (user, priority) group's streams in the order
    they were last served, longest ago (or never) first, ties in running
    order; the groups keep their places. Read from the streams' own
    served times, not from where they sit in ``running``: a step leaves
    them ordered by what it did (charged, borrowing, held back), which is
    not the order they were served in."""
    groups: dict[tuple[str, int], list[Any]] = {}
    for request in running:
        groups.setdefault((request.output_rate_user, request.priority), []).append(request)
    turns: dict[tuple[str, int], Any] = {}
    for key, members in groups.items():
        if len(members) > 1:
            members = sorted(members, key=_served_ns)
        turns[key] = iter(members)
    return [next(turns[(r.output_rate_user, r.priority)]) for r in running]


def _served_ns(request: Any) -> int:
    return request.output_rate_served_ns


def longest_waiting_first(ready: list[Any], running: list[Any]) -> list[Any]:
    """``ready`` with users interleaved, the one served longest ago (among
    all of ``running``) first; a user's streams keep their order."""
    served: dict[str, int] = {}
    for request in running:
        user = request.output_rate_user
        if request.output_rate_served_ns > served.get(user, 0):
            served[user] = request.output_rate_served_ns
    rank: dict[str, int] = {}
    keyed = []
    for position, request in enumerate(ready):
        user = request.output_rate_user
        turn = rank.get(user, 0)
        rank[user] = turn + 1
        keyed.append((turn, served.get(user, 0), position, request))
    keyed.sort(key=lambda item: item[:3])
    return [item[3] for item in keyed]


def throttled_victim(running: list[Any], request: Any, charged: Container[str],
                     can_be_freed: Callable[[Any], bool],
                     left: Callable[[str], int],
                     borrowing: Callable[[Any], bool] | None = None) -> Any | None:
    """A request to preempt instead of vLLM's PRIORITY choice, for
    ``request`` that found no KV blocks: of those after it in ``running``
    (vLLM's loop index stays valid), not charged in this step and whose
    blocks can be freed, first a request lent tokens in this step
    (``borrowing``: it uses capacity beyond its user's guaranteed rate),
    whatever its priority, the lowest priority and latest arrival among
    them; else a throttled one (its user has no budget left) within the
    lowest priority (the one vLLM would preempt from), the latest arrival.
    None: leave the choice to vLLM."""
    try:
        start = running.index(request) + 1
    except ValueError:
        return None
    free = [r for r in running[start:] if r.request_id not in charged and can_be_freed(r)]
    if borrowing is not None:
        lent = [r for r in free if borrowing(r)]
        if lent:
            return max(lent, key=lambda r: (r.priority, r.arrival_time))
    lowest = max(r.priority for r in running)
    candidates = [r for r in free
                  if r.priority == lowest and left(r.output_rate_user) <= 0]
    return max(candidates, key=lambda r: r.arrival_time) if candidates else None
