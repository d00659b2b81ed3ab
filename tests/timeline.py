"""What a `make test` run spent where: ``TEST_TIMELINE=FILE make test`` has
the suite write one line per test phase (tests/conftest.py); this sums it
per worker and per module and shows when each worker went idle.

``python tests/timeline.py FILE [--top N]``
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/timeline.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=25, help="modules to list (longest first)")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in open(args.file) if line.strip()]
    if not rows:
        print("no lines")
        return 1
    t0 = min(r["start"] for r in rows)
    workers: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        workers[r["worker"]].append(r)
    print(f"{len(rows)} phases, {len({r['test'] for r in rows})} tests, "
          f"{max(r['stop'] for r in rows) - t0:.0f} s first start to last stop")
    print("\n| worker | busy s | first start s | last stop s | modules in order |")
    print("|---|---:|---:|---:|---|")
    for w in sorted(workers):
        rs = sorted(workers[w], key=lambda r: r["start"])
        order: list[str] = []
        for r in rs:
            module = r["test"].split("::")[0].rsplit("/", 1)[-1]
            if not order or order[-1] != module:
                order.append(module)
        busy = sum(r["stop"] - r["start"] for r in rs)
        print(f"| {w} | {busy:.0f} | {rs[0]['start'] - t0:.0f} | {rs[-1]['stop'] - t0:.0f} | "
              f"{', '.join(order)} |")
    per: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        module = r["test"].split("::")[0]
        span = per.setdefault((r["worker"], module), [r["start"], r["stop"], 0.0])
        span[0], span[1] = min(span[0], r["start"]), max(span[1], r["stop"])
        span[2] += r["stop"] - r["start"]
    print(f"\n| module | worker | from s | to s | busy s |")
    print("|---|---|---:|---:|---:|")
    for (w, module), (a, b, busy) in sorted(per.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"| {module} | {w} | {a - t0:.0f} | {b - t0:.0f} | {busy:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
