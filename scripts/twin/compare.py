"""``vllm-output-rate twin compare``: one workload under two or more
configurations, the users' figures side by side.

``vllm-output-rate twin compare --workload FILE --out DIR
--config NAME="OPTIONS" --config NAME="OPTIONS" [...] [options of every run]``

Each ``--config`` names a configuration and its own ``twin run`` options
(split as a shell would: ``base="--output-rate-default-tokens-per-second
10"``, ``strict="--output-rate-limits-file strict.yaml"``, ``none=""`` for
no limits, ``cap="--max-num-active-seqs 4"``); the options after the
configurations go to every run, before its own. Every run is a full
``twin run`` in ``DIR/NAME`` (its ``summary.json``, ``report.md``, event log
...). The first configuration is the baseline: ``compare.md`` has one table,
a row per user and configuration (rate, TTFT p50/p90/p99, spacing p50/p90,
time throttled), every other configuration's cells with the difference to
the baseline's, the largest changes in words, and the per-user rate
timelines and TTFT CDFs side by side (``compare-*.png``); ``compare.json``
(``COMPARE_SCHEMA``) the same figures.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

SCHEMA = 1
#: (key, title, unit scale, digits): the figures compared, from summary.json
METRICS = (
    ("rate_tok_s", "rate tok/s", 1.0, 2),
    ("ttft_p50_s", "TTFT p50 ms", 1e3, 1),
    ("ttft_p90_s", "TTFT p90 ms", 1e3, 1),
    ("ttft_p99_s", "TTFT p99 ms", 1e3, 1),
    ("itl_p50_s", "spacing p50 ms", 1e3, 1),
    ("itl_p90_s", "spacing p90 ms", 1e3, 1),
    ("throttled_s", "throttled s", 1.0, 2),
)

_NUM = {"type": ["number", "null"]}
COMPARE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "vllm-output-rate twin compare",
    "type": "object",
    "required": ["schema", "baseline", "configs", "users"],
    "properties": {
        "schema": {"const": SCHEMA},
        "baseline": {"type": "string", "description": "the first configuration's name"},
        "configs": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "options": {"type": "array", "items": {"type": "string"}},
            "out": {"type": "string", "description": "its run folder, relative to --out"},
            "scheduler": {"type": "string"}, "limits": {"type": ["object", "null"]},
            "virtual_s": {"type": "number"}}}},
        "users": {"type": "object", "description": "user -> configuration -> figures",
                  "additionalProperties": {"type": "object", "additionalProperties": {
                      "type": "object", "properties": {
                          **{key: _NUM for key, *_ in METRICS},
                          "diff": {"type": "object", "description":
                                   "figure -> {abs, rel} against the baseline (absent for it; "
                                   "null where either side has no value)"}}}}},
    },
}


class CompareError(ValueError):
    """A compare command that cannot run as asked (one line)."""


def parse_configs(argv: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(name, options) of each ``--config NAME=OPTIONS`` and the other options."""
    configs: list[tuple[str, list[str]]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise CompareError("--config: expected NAME=OPTIONS")
                value, i = argv[i + 1], i + 2
            else:
                value, i = arg[len("--config="):], i + 1
            name, sep, options = value.partition("=")
            if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
                raise CompareError(f"--config {value!r}: expected NAME=OPTIONS, NAME of "
                                   f"letters, digits, - and _")
            if any(name == n for n, _ in configs):
                raise CompareError(f"--config {name}: given twice")
            try:
                configs.append((name, shlex.split(options)))
            except ValueError as exc:
                raise CompareError(f"--config {name}: {exc}") from None
        else:
            rest.append(arg)
            i += 1
    if len(configs) < 2:
        raise CompareError("give two or more --config NAME=OPTIONS (the first is the baseline)")
    for flag in ("--out", "--workload"):
        for _, options in configs:
            if flag in options:
                raise CompareError(f"{flag}: give it once, for every configuration")
    return configs, rest


def figures(user: dict[str, Any]) -> dict[str, float | None]:
    return {"rate_tok_s": user["rate_tok_s"],
            "ttft_p50_s": user["ttft_s"]["p50"], "ttft_p90_s": user["ttft_s"]["p90"],
            "ttft_p99_s": user["ttft_s"]["p99"],
            "itl_p50_s": user["itl_s"]["p50"], "itl_p90_s": user["itl_s"]["p90"],
            "throttled_s": user["throttled_s"]}


def compare_summaries(names: list[str], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """``compare.json``'s users: user -> configuration -> figures (and,
    but for the baseline, their difference to the baseline's)."""
    users = sorted({u for s in summaries for u in s["users"]})
    out: dict[str, Any] = {}
    for user in users:
        row: dict[str, Any] = {}
        base = None
        for name, summary in zip(names, summaries):
            u = summary["users"].get(user)
            figs = figures(u) if u is not None else {key: None for key, *_ in METRICS}
            if base is None:
                base = figs
            else:
                diff = {}
                for key, *_ in METRICS:
                    a, b = base[key], figs[key]
                    if a is None or b is None:
                        diff[key] = None
                    else:
                        diff[key] = {"abs": round(b - a, 6),
                                     "rel": round((b - a) / a, 4) if a else None}
                figs = {**figs, "diff": diff}
            row[name] = figs
        out[user] = row
    return out


def _cell(value: float | None, scale: float, digits: int, diff: Any = None) -> str:
    if value is None:
        return "–"
    text = f"{value * scale:.{digits}f}"
    if diff:
        text += f" ({diff['abs'] * scale:+.{digits}f}"
        if diff["rel"] is not None and abs(diff["rel"]) >= 0.005:
            text += f", {diff['rel']:+.0%}"
        text += ")"
    return text


def changes(compare: dict[str, Any], names: list[str], top: int = 8) -> list[str]:
    """The largest relative changes against the baseline, in words."""
    found = []
    for user, row in compare.items():
        for name in names[1:]:
            for key, title, scale, digits in METRICS:
                d = row[name]["diff"][key]
                if d is None or d["rel"] is None or abs(d["rel"]) < 0.05:
                    continue
                before, after = row[names[0]][key], row[name][key]
                unit = title.split()[-1]
                found.append((abs(d["rel"]), f"{user}'s {' '.join(title.split()[:-1])} goes from "
                              f"{before * scale:.{digits}f} to {after * scale:.{digits}f} {unit} "
                              f"({d['rel']:+.0%}) with {name}"))
    found.sort(key=lambda x: -x[0])
    return [text for _, text in found[:top]]


def render_compare(names: list[str], options: list[list[str]],
                   summaries: list[dict[str, Any]], compare: dict[str, Any],
                   plots: dict[str, str]) -> str:
    lines = ["# What-if twin: compare", "",
             f"Workload `{summaries[0]['run']['workload']}`, "
             f"{summaries[0]['run']['requests']} requests. Baseline: `{names[0]}`; the other "
             f"configurations' cells show the difference to it (absolute, relative).", ""]
    for name, opts, s in zip(names, options, summaries):
        run = s["run"]
        lines.append(f"- `{name}`: `{shlex.join(opts) or '(no options)'}`: "
                     f"`{run['scheduler'].rsplit('.', 1)[-1]}`, {run['virtual_s']:.1f} virtual s"
                     f" ([report]({name}/report.md))")
    st = summaries[0]["run"]["step_time"]
    if st.get("is_estimate"):
        lines += ["", "Step time: an estimate, not a measurement of any engine "
                      "(`twin calibrate`): figures in time are only as good as it."]
    said = changes(compare, names)
    if said:
        lines += ["", "Largest changes:", ""] + [f"- {t}" for t in said]
    lines += ["", "| user | config | " + " | ".join(t for _, t, _, _ in METRICS) + " |",
              "|---|---|" + "---:|" * len(METRICS)]
    for user, row in compare.items():
        for i, name in enumerate(names):
            figs = row[name]
            cells = [_cell(figs[key], scale, digits, figs.get("diff", {}).get(key))
                     for key, _, scale, digits in METRICS]
            lines.append(f"| {user if i == 0 else ''} | {name} | " + " | ".join(cells) + " |")
    for title, key in (("Per-user rate", "rate"), ("TTFT CDF per user", "ttft")):
        if plots.get(key):
            lines += ["", f"![{title}]({plots[key]})"]
    return "\n".join(lines) + "\n"


def run_compare(argv: list[str], plots: bool = True) -> dict[str, Any]:
    """Run every configuration (``twin.run.Twin``) and write ``compare.md``,
    ``compare.json`` and the plots."""
    from vllm_output_rate.tools.twin.config import TwinConfig
    from vllm_output_rate.tools.twin.run import Twin

    configs, common = parse_configs(argv)
    out = None
    for i, arg in enumerate(common):
        if arg == "--out" and i + 1 < len(common):
            out = common[i + 1]
        elif arg.startswith("--out="):
            out = arg[len("--out="):]
    if out is None:
        raise CompareError("--out DIR: missing")
    out_dir = Path(out)
    # every run in its own folder: the common --out replaced by OUT/NAME
    argv_run, skip = [], False
    for arg in common:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        argv_run.append(arg)
    names, summaries, timelines = [], [], []
    for name, options in configs:
        twin = Twin(TwinConfig.from_argv([*argv_run, *options, "--out", str(out_dir / name),
                                          *([] if plots else ["--no-plots"])]))
        summaries.append(twin.run())
        timelines.append(twin.stats.timeline())
        names.append(name)
        print(f"{name}: {summaries[-1]['run']['virtual_s']:.1f} virtual s in "
              f"{summaries[-1]['run']['wall_s']:.1f} wall s", file=sys.stderr)
    compare = compare_summaries(names, summaries)
    plot_files = {}
    if plots:
        from vllm_output_rate.tools.twin.plots import compare_plots

        plot_files = compare_plots(names, timelines, out_dir)
    doc = {
        "schema": SCHEMA, "baseline": names[0],
        "configs": [{"name": n, "options": o, "out": n,
                     "scheduler": s["run"]["scheduler"], "limits": s["run"]["limits"],
                     "virtual_s": s["run"]["virtual_s"]}
                    for n, (_, o), s in zip(names, configs, summaries)],
        "users": compare,
        "plots": plot_files,
    }
    (out_dir / "compare.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / "compare.md").write_text(
        render_compare(names, [o for _, o in configs], summaries, compare, plot_files))
    return doc
