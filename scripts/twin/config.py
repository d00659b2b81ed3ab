"""What one twin run takes: ``TwinConfig``, and ``Twin(config)`` runs it
(``twin.run``).

The command line is one way to make one: ``TwinConfig.from_argv`` parses
``twin run``'s options with vLLM's own ``EngineArgs`` parser and the
plugin's options added (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--async-scheduling``, ``--num-gpu-blocks-override``,
``--output-rate-default-tokens-per-second``, ``--output-rate-limits-file``
...): the same flag means the same thing as for ``serve``, and the
scheduler class is the one ``serve`` would run (the plugin's with limits,
vLLM's without). Options about devices, parallelism or the API server are
accepted and play no part. ``--model`` defaults to the tiny generated
model; only its config is read. Not in the twin:
``--output-rate-shared-state``.

A program makes one directly: the workload in memory
(``workload.workload_of_lines``), vLLM's options as ``engine_args(...)``,
the limits as ``TwinLimits`` (a limits file's text in memory is written
into the run's folder).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.twin.step_time import DEFAULT as DEFAULT_STEP_TIME
from vllm_output_rate.tools.twin.step_time import StepTimeModel, load_step_time
from vllm_output_rate.tools.twin.workload import Workload, read_workload


class TwinError(Exception):
    """A twin run that cannot be made as asked (one line, no traceback)."""


@dataclass(frozen=True)
class TwinLimits:
    """The limiter's options, as ``vllm-output-rate serve`` takes them (none
    given: vLLM's own scheduler, the feature off). The run keeps its own
    copy of the limits file in its output folder: a workload's limits lines
    rewrite that copy, never the file given."""

    #: ``--output-rate-default-tokens-per-second``
    default_rate: Any = None
    #: ``--output-rate-user-tokens-per-second`` (a JSON object, or a dict)
    user_rates: Any = None
    #: ``--output-rate-limits-file``: copied into the run's folder
    limits_file: str | None = None
    #: a limits file's content (YAML or JSON) instead of ``limits_file``:
    #: written into the run's folder as ``limits.yaml``
    limits_text: str | None = None
    #: ``--output-rate-unlisted-users``
    unlisted_users: str | None = None
    #: ``--output-rate-default-prompt-tokens-per-second``
    default_prompt_rate: Any = None
    #: ``--output-rate-prefill-ahead``
    prefill_ahead: bool = False


@dataclass
class TwinConfig:
    """One twin run: the workload, the engine and the limiter it runs on,
    the step-time model and where the outputs go."""

    #: the requests and limits changes (``workload.read_workload`` reads a
    #: file, ``workload.workload_of_lines`` takes them in memory)
    workload: Workload
    #: the output folder (made if missing)
    out: Path
    #: vLLM's engine options (``vllm.engine.arg_utils.EngineArgs``: the
    #: model, whose config alone is read, the scheduler's sizes and policy,
    #: ``--seed``, which seeds the prompts' token ids): ``engine_args(...)``
    engine: Any
    limits: TwinLimits = field(default_factory=TwinLimits)
    #: how long a step takes (``step_time``; default: a fixed estimate)
    step_time: StepTimeModel = DEFAULT_STEP_TIME
    #: stop at this virtual second even with requests left (their tokens so
    #: far count; those without a first token are counted unstarted); None:
    #: when every request has finished
    until_s: float | None = None
    #: plots in report.md (per-user rate, TTFT CDF, KV held throttled)
    plots: bool = True
    #: keep every charge (the summary's per-user figures read them)
    keep_charges: bool = False
    #: a gate in front of the engine (``fairness.gateway.GatewayEmulation``):
    #: its ``admit(req_id, user, prompt_tokens, max_tokens, now_ns)`` refuses
    #: a request (counted per user) and ``finished(req_id, prompt_tokens,
    #: output_tokens, now_ns)`` hears of every admitted one that ends
    admission: Any = None

    @classmethod
    def from_argv(cls, argv: list[str], **fields: Any) -> TwinConfig:
        """``twin run``'s options (``RUN_USAGE``), as its command line
        takes them; ``fields``: the rest of the config (``keep_charges``,
        ``admission``)."""
        from vllm.engine.arg_utils import EngineArgs

        args = build_parser().parse_args(argv)
        if getattr(args, "output_rate_shared_state", None):
            raise TwinError("--output-rate-shared-state: not in the twin (one engine)")
        if args.model is None:
            args.model = _tiny_model()
        limits = TwinLimits(default_rate=args.default_user_output_tokens_per_second,
                            user_rates=args.user_output_tokens_per_second,
                            limits_file=args.output_rate_limits_file,
                            unlisted_users=args.output_rate_unlisted_users,
                            default_prompt_rate=args.default_user_prompt_tokens_per_second,
                            prefill_ahead=args.output_rate_prefill_ahead)
        # as ``serve`` takes them: the plugin checks its own options here too
        # (the run puts its limits in from ``limits``, its copy of the file)
        engine = EngineArgs.from_cli_args(args)
        return cls(workload=read_workload(args.workload), out=Path(args.out), engine=engine,
                   limits=limits, step_time=load_step_time(args.step_time), until_s=args.until,
                   plots=not args.no_plots, **fields)


def engine_args(**fields: Any) -> Any:
    """vLLM's ``EngineArgs`` as ``serve``'s parser leaves them with no
    options, with ``fields`` set (``model``: default the tiny generated
    model)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args([])
    values = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(EngineArgs)
              if hasattr(parsed, f.name)}
    values.update(fields, model=fields.get("model") or _tiny_model())
    return EngineArgs(**values)


def _tiny_model() -> str:
    from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def scheduler_options(engine: Any) -> dict[str, Any]:
    """The scheduler's options of ``engine`` that are set (the summary's
    ``options``)."""
    names = ("max_num_seqs", "max_num_active_seqs", "max_num_batched_tokens", "max_model_len",
             "enable_chunked_prefill", "enable_prefix_caching", "async_scheduling",
             "num_gpu_blocks_override", "block_size", "scheduling_policy")
    return {n: getattr(engine, n) for n in names if getattr(engine, n, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    """``twin run``'s parser: vLLM's engine options, the plugin's, the twin's."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser, SortedHelpFormatter

    from vllm_output_rate import plugin
    from vllm_output_rate.tools.common.help_text import plain_formatter

    plugin.register()  # the plugin's options on vLLM's parser
    parser = FlexibleArgumentParser(
        prog="vllm-output-rate twin run", usage=RUN_USAGE,
        description="Run vLLM's scheduler with the output-rate limiter on a workload in\n"
                    "virtual time. Takes vllm serve's scheduler and limit options; those\n"
                    "about devices, parallelism or the API server play no part.",
        epilog=RUN_EPILOG.format(group=plugin.GROUP_TITLE),
        formatter_class=plain_formatter(SortedHelpFormatter))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)
    twin = parser.add_argument_group(
        "Twin", description="The twin's own options: the workload, the outputs, the clock.")
    twin.add_argument("--workload", required=True, help="the workload (JSON Lines)")
    twin.add_argument("--out", required=True, help="the output directory")
    twin.add_argument("--step-time", default=None,
                      help="the step-time model (JSON); default: a fixed estimate")
    twin.add_argument("--no-plots", action="store_true",
                      help="no plots in report.md (per-user rate, TTFT CDF, KV held throttled)")
    twin.add_argument("--until", type=float, default=None, metavar="SECONDS",
                      help="stop at this virtual second even with requests left (their tokens "
                      "so far count; those without a first token are counted unstarted); "
                      "default: when every request has finished")
    return parser


RUN_USAGE = "vllm-output-rate twin run --workload FILE --out DIR [options]"
RUN_EPILOG = (
    "For the twin's own options:  vllm-output-rate twin run --help=Twin\n"
    "For the limits:              vllm-output-rate twin run --help={group}\n"
    "For the scheduler:           vllm-output-rate twin run --help=SchedulerConfig\n"
    "For a flag:                  vllm-output-rate twin run --help=max-num-seqs\n"
    "For full list:               vllm-output-rate twin run --help=all\n")
