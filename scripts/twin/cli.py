"""The what-if twin's command: ``vllm-output-rate twin COMMAND``.

``vllm-output-rate twin run --workload FILE --out DIR [--model DIR]
[--step-time FILE] [--seed N] [vllm serve's scheduler and limit options]``
(``twin.config``, ``twin.run``);
``vllm-output-rate twin workload flood|tiers|bursts|clients|burstgpt --out FILE ...``
(``twin.workload``);
``vllm-output-rate twin compare --config NAME="OPTIONS" ... --workload FILE --out DIR``
(``twin.compare``), ``vllm-output-rate twin calibrate ...`` (``twin.calibrate``),
``vllm-output-rate twin accuracy ...`` (``twin.accuracy``),
``vllm-output-rate twin scale ...`` (``twin.scale``).
"""

from __future__ import annotations

import sys

from vllm_output_rate.tools.twin.config import TwinConfig, TwinError
from vllm_output_rate.tools.twin.run import Twin

#: The twin's subcommands, one line each (``twin --help``).
SUBCOMMANDS = {
    "run": "vLLM's scheduler and the limiter on a workload in virtual time; a report",
    "compare": "one workload under several configurations, side by side",
    "workload": "write a workload: generated (flood, tiers, bursts, clients) or from BurstGPT",
    "calibrate": "fit the step-time model from an engine's event log, or estimate one",
    "accuracy": "replay workloads on real engines and in the twin; compare per user",
    "scale": "the twin's own speed and memory against requests resident and users",
}

USAGE = """usage: vllm-output-rate twin run --workload FILE --out DIR [options]
       vllm-output-rate twin compare --workload FILE --out DIR --config NAME="OPTIONS"
           --config NAME="OPTIONS" [...] [options of every run]
       vllm-output-rate twin workload {flood,tiers,bursts,clients} --out FILE [options]
       vllm-output-rate twin workload burstgpt --trace FILE.csv --users RULE --out FILE [options]
       vllm-output-rate twin calibrate --events FILE [--prompts FILE] --out FILE
       vllm-output-rate twin calibrate --url URL --model NAME --events FILE --out FILE
       vllm-output-rate twin calibrate --model DIR --gpu NAME --out FILE
       vllm-output-rate twin accuracy --out DIR [--model DIR] [--replays N] [--workload NAME ...]
       vllm-output-rate twin scale --out DIR [--sizes R ...] [--users U ...] [options]
"""


def usage() -> str:
    """``twin --help``: the usage lines and a line per subcommand."""
    lines = [USAGE, "commands:"]
    lines += [f"  {name:<11}{text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "vllm-output-rate twin COMMAND --help: the command's options"]
    return "\n".join(lines)


def compare_main(argv: list[str]) -> int:
    from vllm_output_rate.config import OutputRateConfigError
    from vllm_output_rate.tools.common.help_text import plain
    from vllm_output_rate.tools.twin import compare as twin_compare
    from vllm_output_rate.tools.twin.step_time import StepTimeError
    from vllm_output_rate.tools.twin.workload import WorkloadError

    if not argv or argv[0] in ("-h", "--help"):
        print(plain(twin_compare.__doc__.split("\n\n", 2)[1]))
        return 0 if argv else 2
    plots = "--no-plots" not in argv
    try:
        doc = twin_compare.run_compare([a for a in argv if a != "--no-plots"], plots)
    except (twin_compare.CompareError, TwinError, WorkloadError, StepTimeError,
            OutputRateConfigError) as exc:
        print(f"vllm-output-rate twin compare: error: {exc}", file=sys.stderr)
        return 2
    names = [c["name"] for c in doc["configs"]]
    print(f"{len(names)} configurations, {len(doc['users'])} users: compare.md, compare.json "
          f"beside the runs' folders {', '.join(n + '/' for n in names)}")
    return 0


def scale_main(argv: list[str]) -> int:
    from vllm_output_rate.config import OutputRateConfigError
    from vllm_output_rate.tools.twin import scale as twin_scale

    if argv and argv[0] in ("-h", "--help"):
        twin_scale.build_parser().print_help()
        return 0
    try:
        doc = twin_scale.run_scale(argv)
    except (twin_scale.ScaleError, TwinError, OutputRateConfigError) as exc:
        print(f"vllm-output-rate twin scale: error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(doc['cells'])} cells: {doc['facts']['out']}/scale.md, scale.json")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "workload":
        from vllm_output_rate.tools.twin.workload import main as workload_main

        return workload_main(rest)
    if command == "compare":
        return compare_main(rest)
    if command == "calibrate":
        from vllm_output_rate.tools.twin.calibrate import main as calibrate_main

        return calibrate_main(rest)
    if command == "accuracy":
        from vllm_output_rate.tools.twin.accuracy import main as accuracy_main

        return accuracy_main(rest)
    if command == "scale":
        return scale_main(rest)
    if command != "run":
        print(f"vllm-output-rate twin: unknown command {command!r}\n{usage()}", file=sys.stderr)
        return 2
    from vllm_output_rate.config import OutputRateConfigError
    from vllm_output_rate.tools.twin.step_time import StepTimeError
    from vllm_output_rate.tools.twin.workload import WorkloadError

    try:
        twin = Twin(TwinConfig.from_argv(rest))
        summary = twin.run()
    except (TwinError, WorkloadError, StepTimeError, OutputRateConfigError) as exc:
        print(f"vllm-output-rate twin run: error: {exc}", file=sys.stderr)
        return 2
    run = summary["run"]
    print(f"{run['virtual_s']:.1f} virtual s in {run['wall_s']:.1f} wall s, {run['steps']} "
          f"steps, {len(summary['users'])} users: {twin.out / 'report.md'}")
    return 0
