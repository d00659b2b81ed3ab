"""The fairness benchmark's report: ``fairness.md``, its tables and the
goals checked."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.tools.fairness import engine as fe
from vllm_output_rate.tools.fairness.scenarios import Scale


def _f(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def render(results: dict[str, Any], scale: Scale, command: str) -> str:
    if results.get("engine") == "cpu":
        head = (f"## The real CPU engine: {scale.max_num_seqs} sequences, rates sized on a "
                f"nominal {scale.step_s * 1e3:g} ms step ({scale.capacity:,.0f} tok/s), "
                f"{scale.duration_s:g} s of arrivals (client-side times; throughput over the "
                f"run to {fe.GRACE_S:g} s after the arrivals)")
    else:
        head = (f"## Scale `{scale.name}`: {scale.max_num_seqs} sequences, a {scale.step_s * 1e3:g} ms "
                f"step ({scale.capacity:,.0f} tok/s at most), {scale.duration_s:g} s of arrivals")
    lines = [head, "", f"`{command}`", ""]
    for name, res in results["scenarios"].items():
        lines += [f"### {name}", "", res["description"],
                  f"({res['requests']:,} requests, {res['users']:,} users)", "",
                  "| arm | group | users | rate/limit (median) | least rate/limit while backlogged (users) "
                  "| TTFT p50 ms | TTFT p99 ms | spacing p99 ms | borrowed | refused "
                  "| not started |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, fig in res["arms"].items():
            for group, g in fig["groups"].items():
                med = g["rate_tok_s_median"]
                lines.append(
                    f"| {arm} | {group} | {g['users']} | "
                    f"{_f(None if med is None else med / g['limit_tok_s'], digits=2)} | "
                    f"{_f(g['held_while_backlogged_min'], digits=2)} ({g['backlogged']}) | "
                    f"{_f(g['ttft_s']['p50'], 1e3)} | "
                    f"{_f(g['ttft_s']['p99'], 1e3)} | {_f(g['itl_p99_s'], 1e3)} | "
                    f"{g['borrowed_tokens']:,} | {g['refused']:,}/{g['requests']:,} | "
                    f"{g.get('unstarted', 0):,} |")
        lines += ["", "| arm | throughput tok/s | weighted Jain (backlogged) | Jain of borrowed / fair "
                      "| virtual s | wall s |", "|---|---:|---:|---:|---:|---:|"]
        for arm, fig in res["arms"].items():
            lines.append(f"| {arm} | {fig['throughput_tok_s']:,.0f} | {_f(fig['jain_weighted'], digits=3)} "
                         f"| {_f(fig['jain_borrowed'], digits=3)} | {fig['virtual_s']:.1f} "
                         f"| {fig['wall_s']:.1f} |")
        engine_side = [(arm, group, g) for arm, fig in [*res["arms"].items(), *(
            (f"{a} without the flood", f) for a, f in res["baseline"].items())]
            for group, g in fig["groups"].items() if g.get("ttft_engine_s")]
        if engine_side:
            lines += ["", "TTFT engine-side (this project's arms: from the scheduler receiving "
                      "the request to the step that sampled its first token, in the engine's "
                      "event log):", "",
                      "| arm | group | TTFT p50 ms | TTFT p99 ms |", "|---|---|---:|---:|"]
            lines += [f"| {arm} | {group} | {_f(g['ttft_engine_s']['p50'], 1e3)} | "
                      f"{_f(g['ttft_engine_s']['p99'], 1e3)} |" for arm, group, g in engine_side]
            spacing = [(arm, group, g) for arm, group, g in engine_side if "itl_engine_p99_s" in g]
            if spacing:
                lines += ["", "Token spacing engine-side (the same arms: from a step that gave "
                          "a request tokens to the next, in the event log):", "",
                          "| arm | group | spacing p99 ms |", "|---|---|---:|"]
                lines += [f"| {arm} | {group} | {_f(g['itl_engine_p99_s'], 1e3)} |"
                          for arm, group, g in spacing]
        if res["baseline"]:
            lines += ["", "Without the flood (the victims' baseline):", "",
                      "| arm | steady TTFT p50 ms | steady TTFT p99 ms | spacing p99 ms |",
                      "|---|---:|---:|---:|"]
            for arm, fig in res["baseline"].items():
                g = fig["groups"].get("steady", {})
                lines.append(f"| {arm} | {_f(g.get('ttft_s', {}).get('p50'), 1e3)} | "
                             f"{_f(g.get('ttft_s', {}).get('p99'), 1e3)} | "
                             f"{_f(g.get('itl_p99_s'), 1e3)} |")
        lines.append("")
    lines += ["### Goals", "", "| goal | value | target | met |", "|---|---:|---|---|"]
    for g in results["goals"]:
        value = "– (no user backlogged)" if g["value"] is None else g["value"]
        lines.append(f"| {g['goal']} | {value} | {g['target']} | "
                     f"{'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"
