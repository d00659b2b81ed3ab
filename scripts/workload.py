"""The what-if twin's workloads: the JSON Lines format, its reader and the
built-in generators.

One JSON object a line (``WORKLOAD_SCHEMA``), times in seconds from the
start of the run (virtual time), sizes in tokens::

    {"t": 0.25, "user": "alice", "prompt_tokens": 512, "max_tokens": 128}
    {"t": 30.0, "limits_file": "limits-after.yaml"}

A request line adds one request at ``t`` (it generates exactly
``max_tokens`` tokens: ``ignore_eos``). A limits line replaces the content
of the run's limits file with that file's (a path relative to the workload
file) at ``t``, as an operator editing it live: the scheduler's watcher
reads it then and puts it in force at the next step. Lines are taken in
time order (ties in file order); blank lines and lines starting with ``#``
are skipped. A bad line is refused with its number and field
(``workload.jsonl:7: max_tokens: expected a positive integer, got -3``).

Generators (``vllm-output-rate twin workload KIND --out FILE [params]
--seed N``), each deterministic given its seed:

* ``flood``: one user opens many streams at once beside steady users
  (Poisson arrivals);
* ``tiers``: users in named tiers (``free:4,gold:2``), each a Poisson
  source (tier names prefix the user ids: ``free-0``, ``gold-1``);
* ``bursts``: VTC's ``fair_bench`` shapes: a steady user beside one whose
  arrivals come on and off (``--on-s``/``--off-s``), overloading while on;
* ``clients``: many heterogeneous clients in the manner of ServeGen, each
  with its own arrival rate (log-normal across clients) and its own
  log-normal prompt and output lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

_POSITIVE_INT = {"type": "integer", "minimum": 1}
_TIME = {"type": "number", "minimum": 0, "description": "seconds from the start of the run"}

WORKLOAD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "vllm-output-rate twin workload line",
    "oneOf": [
        {"title": "request", "type": "object", "additionalProperties": False,
         "required": ["t", "user", "prompt_tokens", "max_tokens"],
         "properties": {"t": _TIME, "user": {"type": "string", "minLength": 1},
                        "prompt_tokens": _POSITIVE_INT, "max_tokens": _POSITIVE_INT}},
        {"title": "limits change", "type": "object", "additionalProperties": False,
         "required": ["t", "limits_file"],
         "properties": {"t": _TIME, "limits_file": {
             "type": "string", "minLength": 1,
             "description": "a limits file (relative to the workload file) whose "
                            "content replaces the run's limits file at t"}}},
    ],
}

REQUEST_FIELDS = ("t", "user", "prompt_tokens", "max_tokens")
LIMITS_FIELDS = ("t", "limits_file")


class WorkloadError(ValueError):
    """A workload line that does not follow the schema."""


@dataclass(frozen=True)
class WorkloadRequest:
    t: float
    user: str
    prompt_tokens: int
    max_tokens: int
    line: int


@dataclass(frozen=True)
class LimitsChangeAt:
    t: float
    #: the file whose content becomes the limits file's, and its content
    path: str
    content: bytes
    line: int


@dataclass
class Workload:
    path: str
    #: requests and limits changes, in time order (ties in file order)
    events: list[WorkloadRequest | LimitsChangeAt]

    @property
    def requests(self) -> list[WorkloadRequest]:
        return [e for e in self.events if isinstance(e, WorkloadRequest)]

    @property
    def limits_changes(self) -> list[LimitsChangeAt]:
        return [e for e in self.events if isinstance(e, LimitsChangeAt)]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_line(obj: Any, where: str, base_dir: str, line: int) -> WorkloadRequest | LimitsChangeAt:
    """One parsed line, checked (``where``: ``file:line`` for messages)."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "t" not in obj:
        raise WorkloadError(f"{where}: t: missing")
    t = obj["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise WorkloadError(f"{where}: t: expected a number of seconds >= 0, got {t!r}")
    fields = LIMITS_FIELDS if "limits_file" in obj else REQUEST_FIELDS
    for key in obj:
        if key not in fields:
            kind = "a limits line" if fields is LIMITS_FIELDS else "a request line"
            raise WorkloadError(f"{where}: {key}: unknown field in {kind} "
                                f"(fields: {', '.join(fields)})")
    for key in fields:
        if key not in obj:
            raise WorkloadError(f"{where}: {key}: missing")
    if fields is LIMITS_FIELDS:
        name = obj["limits_file"]
        if not isinstance(name, str) or not name:
            raise WorkloadError(f"{where}: limits_file: expected a file name, got {name!r}")
        path = os.path.join(base_dir, name)
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError as exc:
            raise WorkloadError(f"{where}: limits_file: cannot read {name!r} "
                                f"({exc.strerror or exc})") from None
        return LimitsChangeAt(float(t), path, content, line)
    user = obj["user"]
    if not isinstance(user, str) or not user:
        raise WorkloadError(f"{where}: user: expected a non-empty string, got {user!r}")
    for key in ("prompt_tokens", "max_tokens"):
        if not _positive_int(obj[key]):
            raise WorkloadError(f"{where}: {key}: expected a positive integer, got {obj[key]!r}")
    return WorkloadRequest(float(t), user, obj["prompt_tokens"], obj["max_tokens"], line)


def read_workload(path: str) -> Workload:
    """The workload in ``path``; ``WorkloadError`` names the first bad line."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    base_dir = os.path.dirname(os.path.abspath(path))
    events = []
    for i, text in enumerate(lines, 1):
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc})") from None
        events.append(parse_line(obj, where, base_dir, i))
    if not any(isinstance(e, WorkloadRequest) for e in events):
        raise WorkloadError(f"{path}: no request lines")
    events.sort(key=lambda e: (e.t, e.line))
    return Workload(path, events)


# --------------------------------------------------------------------------- generators


def _poisson(rng: random.Random, rate: float, start: float, end: float):
    """Arrival times of a Poisson process of ``rate``/s over [start, end)."""
    t = start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            return
        yield t


def _lognormal_int(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """A log-normal integer with about this mean, in [1, cap]."""
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def _request(t: float, user: str, prompt: int, max_tokens: int) -> dict[str, Any]:
    return {"t": round(t, 6), "user": user, "prompt_tokens": prompt, "max_tokens": max_tokens}


def gen_flood(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = [_request(rng.uniform(0, 0.1), a.flood_user, a.prompt_tokens, a.flood_max_tokens)
           for _ in range(a.streams)]
    for i in range(a.users):
        for t in _poisson(rng, a.rate, 0.0, a.duration):
            out.append(_request(t, f"steady-{i}", a.prompt_tokens, a.max_tokens))
    return out


def gen_tiers(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for spec in a.tiers.split(","):
        name, _, count = spec.partition(":")
        if not name or not count.isdigit():
            raise WorkloadError(f"--tiers: expected NAME:COUNT[,NAME:COUNT...], got {spec!r}")
        for i in range(int(count)):
            for t in _poisson(rng, a.rate, 0.0, a.duration):
                out.append(_request(t, f"{name}-{i}", a.prompt_tokens, a.max_tokens))
    return out


def gen_bursts(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = [_request(t, "steady", a.prompt_tokens, a.max_tokens)
           for t in _poisson(rng, a.rate, 0.0, a.duration)]
    start = 0.0
    while start < a.duration:
        end = min(start + a.on_s, a.duration)
        out += [_request(t, "bursty", a.prompt_tokens, a.max_tokens)
                for t in _poisson(rng, a.burst_rate, start, end)]
        start += a.on_s + a.off_s
    return out


def gen_clients(rng: random.Random, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    sigma = 1.0
    for i in range(a.clients):
        rate = a.rate * rng.lognormvariate(-sigma * sigma / 2, sigma)
        prompt_mean = a.prompt_tokens * rng.lognormvariate(-0.125, 0.5)
        output_mean = a.max_tokens * rng.lognormvariate(-0.125, 0.5)
        for t in _poisson(rng, rate, 0.0, a.duration):
            out.append(_request(t, f"client-{i}", _lognormal_int(rng, prompt_mean, 0.6, a.cap),
                                _lognormal_int(rng, output_mean, 0.6, a.cap)))
    return out


GENERATORS = {
    "flood": (gen_flood, "one user opens many streams at once beside steady Poisson users"),
    "tiers": (gen_tiers, "users in named tiers, each a Poisson source"),
    "bursts": (gen_bursts, "a steady user beside an on/off bursty one (VTC fair_bench shapes)"),
    "clients": (gen_clients, "many clients, each with its own arrival rate and length "
                             "distributions (log-normal)"),
}


def generate(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The lines of a generated workload, in time order."""
    lines = GENERATORS[kind][0](random.Random(args.seed), args)
    lines.sort(key=lambda d: d["t"])
    return lines


def add_generator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=list(GENERATORS))
    parser.add_argument("--out", required=True, help="the workload file to write (JSON Lines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="requests/s of each steady user, tier user or bursty user's "
                             "steady neighbour; mean rate per client (clients)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--users", type=int, default=3, help="steady users (flood)")
    parser.add_argument("--flood-user", default="flooder")
    parser.add_argument("--streams", type=int, default=32, help="the flooding user's streams")
    parser.add_argument("--flood-max-tokens", type=int, default=1024)
    parser.add_argument("--tiers", default="free:4,gold:2", help="NAME:COUNT,... (tiers)")
    parser.add_argument("--burst-rate", type=float, default=8.0, help="requests/s while on")
    parser.add_argument("--on-s", type=float, default=10.0)
    parser.add_argument("--off-s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--cap", type=int, default=4096,
                        help="largest prompt or output length drawn (clients)")


def write_workload(path: str, lines: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-output-rate twin workload",
                                     description="Write a generated twin workload (JSON Lines).")
    add_generator_args(parser)
    args = parser.parse_args(argv)
    for name in ("duration", "rate", "burst_rate", "on_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: expected a number > 0")
    for name in ("prompt_tokens", "max_tokens", "streams", "flood_max_tokens", "clients", "cap"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer")
    try:
        lines = generate(args.kind, args)
    except WorkloadError as exc:
        parser.error(str(exc))
    write_workload(args.out, lines)
    users = len({line["user"] for line in lines})
    print(f"{args.out}: {len(lines)} requests of {users} users over {args.duration:g} s "
          f"({args.kind}, seed {args.seed})")
    return 0
