"""The vLLM plugin: options, configuration checks and scheduler installation.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM loads it in
every process (API server, engine core, workers), possibly more than once, so
it is idempotent and does nothing costly. It

1. refuses any vLLM but 0.32.x;
2. adds ``--default-user-output-tokens-per-second`` and
   ``--user-output-tokens-per-second`` to vLLM's own argument parser and
   carries them to the engine in ``additional_config["output_rate"]``;
3. after vLLM built its ``VllmConfig``, calls ``configure_output_rate()``:
   with the feature on, refuse unsupported configurations and install the
   scheduler matching ``async_scheduling``; with it off, touch nothing;
4. refuses beam search at the OpenAI serving entry while the feature is on.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

from vllm_patch.config import (
    ADDITIONAL_CONFIG_KEY,
    DEFAULT_OPTION,
    USER_FIELD,
    USERS_OPTION,
    OutputRateConfig,
    OutputRateConfigError,
)
from vllm_patch.internals import check_vllm_version

logger = logging.getLogger("vllm_output_rate")

SYNC_SCHEDULER = "vllm_patch.scheduler.OutputRateScheduler"
ASYNC_SCHEDULER = "vllm_patch.scheduler.OutputRateAsyncScheduler"
_OUR_SCHEDULERS = (SYNC_SCHEDULER, ASYNC_SCHEDULER)

BEAM_SEARCH_REFUSAL = (
    "Beam search is not available on this server: per-user output-rate "
    "limiting is on, and beam search expands candidates outside the "
    "one-token-per-step path the limiter charges. Use sampling instead."
)

#: "1": with the feature on, run async scheduling even where the platform
#: turned it off (vLLM's CPU platform always does). For tests and diagnosis.
FORCE_ASYNC_ENV = "VLLM_OUTPUT_RATE_FORCE_ASYNC_SCHEDULING"

#: Set by configure_output_rate() in the process that parsed the options, to
#: the checked configuration (JSON); processes it spawns that build their own
#: config without the options (the API servers of ``--api-server-count N``)
#: take it from there.
ACTIVE_CONFIG_ENV = "VLLM_OUTPUT_RATE_ACTIVE_CONFIG"

_registered = False
#: Whether the feature is on in this process (set by configure_output_rate).
_feature_on = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    global _registered
    if _registered:
        return
    check_vllm_version()
    _patch_engine_args()
    _patch_beam_search()
    _registered = True


# -- options ------------------------------------------------------------------


def add_output_rate_args(parser: Any) -> Any:
    """Add the two options to a vLLM argument parser (once)."""
    if any(DEFAULT_OPTION in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="Output-rate limits (vllm-output-rate)",
        description="Per-user output-token rate limits inside the scheduler. "
        "The user is vllm_xargs.output_rate_user of each request "
        "(missing: the shared user __anonymous__).",
    )
    group.add_argument(
        DEFAULT_OPTION,
        dest="default_user_output_tokens_per_second",
        default=None,
        type=str,
        help="Output tokens per second for each user without an override, "
        "shared by all of that user's requests. Setting it turns the feature "
        "on; without it vLLM behaves exactly as upstream.",
    )
    group.add_argument(
        USERS_OPTION,
        dest="user_output_tokens_per_second",
        default=None,
        type=str,
        help='Per-user overrides as a JSON object, e.g. \'{"user-a": 100, '
        '"user-b": 0.5}\'.',
    )
    return parser


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "_output_rate", False):
        return

    upstream_add = EngineArgs.add_cli_args
    upstream_from = EngineArgs.from_cli_args.__func__
    upstream_create = EngineArgs.create_engine_config

    def add_cli_args(parser: Any) -> Any:
        return add_output_rate_args(upstream_add(parser))

    def from_cli_args(cls: Any, args: Any) -> Any:
        engine_args = upstream_from(cls, args)
        config = OutputRateConfig.from_options(
            getattr(args, "default_user_output_tokens_per_second", None),
            getattr(args, "user_output_tokens_per_second", None),
        )
        if config is not None:
            engine_args.additional_config = {
                **(engine_args.additional_config or {}),
                ADDITIONAL_CONFIG_KEY: config.to_dict(),
            }
        return engine_args

    @functools.wraps(upstream_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = upstream_create(self, *args, **kwargs)
        inherited = _inherited_config()
        if inherited is not None and ADDITIONAL_CONFIG_KEY not in (vllm_config.additional_config or {}):
            # An API-server process spawned by `serve --api-server-count N`:
            # it never parsed our options, its parent did.
            if vllm_config.additional_config is None:
                vllm_config.additional_config = {}
            vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = inherited
        if os.environ.get(FORCE_ASYNC_ENV) == "1" and output_rate_on(vllm_config):
            # vLLM's CPU platform turns async scheduling off ("not required
            # on CPU"); the engine runs it fine, and this is how the async
            # variant is tested end to end on CPU machines.
            vllm_config.scheduler_config.async_scheduling = True
        configure_output_rate(vllm_config)
        return vllm_config

    create_engine_config._output_rate = True  # type: ignore[attr-defined]
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


# -- configuration ------------------------------------------------------------


def _inherited_config() -> dict[str, Any] | None:
    """The configuration a parent process checked, when this process was
    spawned by it (never the one this process set itself)."""
    raw = os.environ.get(ACTIVE_CONFIG_ENV)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        if data["pid"] == os.getpid():
            return None
        return dict(data["config"])
    except (ValueError, KeyError, TypeError):
        raise OutputRateConfigError(f"{ACTIVE_CONFIG_ENV} is malformed: {raw[:200]!r}") from None


def unsupported_reasons(vllm_config: Any) -> list[str]:
    """Why this configuration cannot run with output-rate limits, if at all.

    Each entry names the option (or model property) to change.
    """
    reasons: list[str] = []
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if vllm_config.speculative_config is not None:
        reasons.append(
            "--speculative-config: speculative decoding can emit several tokens "
            "per step, but each request is charged one token per step"
        )
    if parallel.data_parallel_size > 1:
        reasons.append(
            f"--data-parallel-size {parallel.data_parallel_size}: each rank "
            f"would keep its own limiter and give a user one budget per rank"
        )
    if parallel.pipeline_parallel_size > 1:
        reasons.append(
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size}: "
            f"several micro-batches in flight are not covered"
        )
    if model is not None:
        for flag, what in (
            ("is_multimodal_model", "multimodal models"),
            ("is_encoder_decoder", "encoder-decoder models"),
            ("is_hybrid", "hybrid (attention + state-space) models"),
            ("is_attention_free", "attention-free models"),
            ("is_diffusion", "diffusion models"),
        ):
            if getattr(model, flag, False):
                reasons.append(
                    f"--model {model.model}: {what} are not supported "
                    f"(only standard attention decoders)"
                )
    if vllm_config.diffusion_config is not None:
        reasons.append("--diffusion-config: diffusion models are not supported")
    if vllm_config.cache_config.kv_offloading_size is not None:
        reasons.append(
            "--kv-offloading-size: KV offload changes the KV lifecycle of "
            "throttled requests"
        )
    elif vllm_config.kv_transfer_config is not None:
        reasons.append(
            "--kv-transfer-config: KV connectors change the KV lifecycle of "
            "throttled requests"
        )
    if vllm_config.ec_transfer_config is not None:
        reasons.append("--ec-transfer-config: EC connectors are not supported")
    if getattr(vllm_config.aux_output_config, "enabled", False):
        reasons.append("aux output connector (--aux-output-config) is not supported")
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and _qualname(scheduler_cls) not in _OUR_SCHEDULERS:
        reasons.append(
            f"--scheduler-cls {_qualname(scheduler_cls)}: output-rate limits "
            f"install their own scheduler"
        )
    return reasons


def _qualname(cls: Any) -> str:
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}"


def output_rate_on(vllm_config: Any) -> bool:
    """Whether this configuration asks for output-rate limits."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return ADDITIONAL_CONFIG_KEY in extra


def configure_output_rate(vllm_config: Any) -> OutputRateConfig | None:
    """With limits in ``additional_config``: check and install; else nothing.

    Idempotent. Raises ``OutputRateConfigError`` naming the options at fault.
    """
    global _feature_on
    from vllm_patch.scheduler import output_rate_config_of

    config = output_rate_config_of(vllm_config)
    if config is None:
        return None
    reasons = unsupported_reasons(vllm_config)
    if reasons:
        raise OutputRateConfigError(
            f"{DEFAULT_OPTION} cannot be used with this configuration:\n  - "
            + "\n  - ".join(reasons)
        )
    sched = vllm_config.scheduler_config
    sched.scheduler_cls = ASYNC_SCHEDULER if sched.async_scheduling else SYNC_SCHEDULER
    _setup_telemetry()
    # Canonical form, so the engine core parses exactly what we checked.
    vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = config.to_dict()
    os.environ[ACTIVE_CONFIG_ENV] = json.dumps({"pid": os.getpid(), "config": config.to_dict()})
    _feature_on = True
    logger.info(
        "output-rate limits on: default %s tok/s per user, %d override(s), "
        "scheduler %s",
        config.default_rate,
        len(config.user_rates),
        sched.scheduler_cls,
    )
    return config


def _setup_telemetry() -> None:
    """In the serving process: a directory for engine snapshots (inherited by
    the engine core through the environment) and the collector that shows
    them on vLLM's ``/metrics``. ``VLLM_OUTPUT_RATE_TELEMETRY=0`` turns it off."""
    import os
    import tempfile

    from telemetry import collector
    from telemetry.engine import TELEMETRY_DIR_ENV, TELEMETRY_SWITCH_ENV

    if os.environ.get(TELEMETRY_SWITCH_ENV, "1") == "0":
        return
    directory = os.environ.get(TELEMETRY_DIR_ENV)
    if not directory:
        directory = tempfile.mkdtemp(prefix="vllm-output-rate-telemetry-")
        os.environ[TELEMETRY_DIR_ENV] = directory
        # Ours to remove when this process (the server's top process, which
        # outlives its engine core and API servers) exits.
        import atexit
        import shutil

        atexit.register(shutil.rmtree, directory, True)
    collector.install(directory)


# -- beam search ----------------------------------------------------------------


def user_field_error(xargs: Any) -> str | None:
    """Why a request's ``vllm_xargs.output_rate_user`` is unusable, or None.

    A string, a number (taken as its string form), null or absent are
    fine; anything else (a boolean, an object, a list) is refused rather
    than silently served as the anonymous user."""
    if not isinstance(xargs, dict) or USER_FIELD not in xargs:
        return None
    value = xargs[USER_FIELD]
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    return (f"vllm_xargs.{USER_FIELD} must be a string (the user the output-rate "
            f"limit applies to), got {type(value).__name__}")


def _patch_beam_search() -> None:
    """Refuse beam search, and a malformed user field, with HTTP 400 while
    the feature is on."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    except ImportError:  # pragma: no cover - serving extras missing
        return
    for cls in (ChatCompletionRequest, CompletionRequest):
        upstream_sampling = cls.to_sampling_params
        if not getattr(upstream_sampling, "_output_rate", False):

            def to_sampling_params(self: Any, *args: Any, __up=upstream_sampling, **kw: Any):
                if _feature_on:
                    error = user_field_error(getattr(self, "vllm_xargs", None))
                    if error is not None:
                        from vllm.exceptions import VLLMValidationError

                        raise VLLMValidationError(error, parameter="vllm_xargs")
                return __up(self, *args, **kw)

            to_sampling_params._output_rate = True  # type: ignore[attr-defined]
            cls.to_sampling_params = to_sampling_params
        upstream = cls.to_beam_search_params
        if getattr(upstream, "_output_rate", False):
            continue

        def to_beam_search_params(self: Any, *args: Any, __up=upstream, **kw: Any):
            if _feature_on:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    BEAM_SEARCH_REFUSAL, parameter="use_beam_search", value=True
                )
            return __up(self, *args, **kw)

        to_beam_search_params._output_rate = True  # type: ignore[attr-defined]
        cls.to_beam_search_params = to_beam_search_params
