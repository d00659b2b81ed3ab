"""What affinity routing costs in balance: users at their limits hashed to
replicas the way nginx does it (``hash $http_x_user_id consistent``).

nginx's consistent hash (ngx_http_upstream_hash_module, ketama): every
server ``host:port`` gets 160 points per unit of weight on a ring of CRC32
values, point j = CRC32(host, NUL, port, the previous point as 4 bytes
little-endian); a request goes to the first point at or after CRC32(key).
``Ring`` is that algorithm (``tests/test_e2e_affinity.py`` checks that it
predicts where the real nginx sends each user).

With U users at their limits on N replicas, a replica's load is the sum of
its users' limits: the report gives the busiest replica against the mean
(what capacity has to be planned for), the coefficient of variation, and
the share of users that move when a replica is added. Usage::

    python -m vllm_output_rate.tools.bench.affinity_balance [--users 100,1000,10000] \\
        [--replicas 2,4,8,16,32,64] [--limits equal|tiers] [--seed 0]
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import struct
import zlib
from collections.abc import Sequence


class Ring:
    """nginx's consistent-hash ring over ``servers`` ("host:port")."""

    def __init__(self, servers: Sequence[str], weight: int = 1) -> None:
        points: dict[int, str] = {}
        for server in servers:
            host, _, port = server.rpartition(":")
            base = zlib.crc32(host.encode() + b"\0" + port.encode())
            prev = 0
            for _ in range(160 * weight):
                value = zlib.crc32(struct.pack("<I", prev), base)
                points.setdefault(value, server)  # nginx keeps the first of equal points
                prev = value
        self.hashes = sorted(points)
        self.servers = [points[h] for h in self.hashes]

    def lookup(self, key: str) -> str:
        h = zlib.crc32(key.encode())
        i = bisect.bisect_left(self.hashes, h)
        return self.servers[i % len(self.servers)]


def limits_of(users: int, kind: str, rng: random.Random) -> list[float]:
    if kind == "equal":
        return [1.0] * users
    # a tier mix: most users small, a few large (free 5, default 50, gold 200)
    return [rng.choices((5.0, 50.0, 200.0), weights=(60, 35, 5))[0] for _ in range(users)]


def balance(users: int, replicas: int, kind: str = "equal", seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    names = [f"user-{rng.getrandbits(64):016x}" for _ in range(users)]
    limits = limits_of(users, kind, rng)
    servers = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(replicas)]
    ring = Ring(servers)
    load = dict.fromkeys(servers, 0.0)
    placement = {}
    for name, limit in zip(names, limits):
        server = ring.lookup(name)
        placement[name] = server
        load[server] += limit
    loads = list(load.values())
    mean = statistics.fmean(loads)
    grown = Ring(servers + [f"10.1.0.1:8000"])
    moved = sum(1 for name in names if grown.lookup(name) != placement[name]) / users
    return {"users": users, "replicas": replicas, "max_over_mean": max(loads) / mean,
            "min_over_mean": min(loads) / mean,
            "cv": statistics.pstdev(loads) / mean, "moved_on_add": moved,
            "ideal_moved": 1 / (replicas + 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.tools.bench.affinity_balance",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="100,1000,10000")
    parser.add_argument("--replicas", default="2,4,8,16,32,64")
    parser.add_argument("--limits", choices=("equal", "tiers"), default="equal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"limits: {args.limits}; nginx consistent hash (160 points per replica)")
    print("| users | replicas | busiest / mean | least / mean | CV | users moved when one is added (ideal) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for users in (int(u) for u in args.users.split(",")):
        for replicas in (int(r) for r in args.replicas.split(",")):
            r = balance(users, replicas, args.limits, args.seed)
            print(f"| {users} | {replicas} | {r['max_over_mean']:.2f} | {r['min_over_mean']:.2f} "
                  f"| {r['cv']:.2f} | {r['moved_on_add']:.1%} ({r['ideal_moved']:.1%}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
