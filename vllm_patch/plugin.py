"""The vLLM plugin: options, configuration checks and scheduler installation.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM loads it in
every process (API server, engine core, workers), possibly more than once, so
it is idempotent and does nothing costly. It

1. checks the vLLM version: on one it does not support (``internals.SUPPORTED``)
   it logs a warning and refuses only the limit options (plain ``vllm serve``
   keeps working);
2. adds its options (``--output-rate-default-tokens-per-second``,
   ``--output-rate-user-tokens-per-second``, ``--output-rate-limits-file`` and
   the rest of the group ``OutputRate``) to vLLM's own argument parser and
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

from vllm_output_rate.config import (
    ADDITIONAL_CONFIG_KEY,
    DEFAULT_OPTION,
    LIMITS_FILE_OPTION,
    SHARED_STATE_OPTION,
    OutputRateConfig,
    TRACEPARENT_FIELD,
    TRACESTATE_FIELD,
    TRUSTED_FIELD,
    USER_FIELD,
    OutputRateConfigError,
    config_of,
    to_wire,
)
from vllm_output_rate.prompt_budget import check_shared
from vllm_output_rate.request_fields import resolve_user, user_from_sources
from vllm_output_rate import frontend, observers, settings, user_label
from vllm_output_rate.shared_settings import parse_shared_state
from vllm_output_rate.internals import UnsupportedVllmVersion, check_vllm_version

logger = logging.getLogger("vllm_output_rate")

SYNC_SCHEDULER = "vllm_output_rate.scheduler.OutputRateScheduler"
ASYNC_SCHEDULER = "vllm_output_rate.scheduler.OutputRateAsyncScheduler"
_OUR_SCHEDULERS = (SYNC_SCHEDULER, ASYNC_SCHEDULER)

BEAM_SEARCH_REFUSAL = (
    "Beam search is not available on this server: per-user output-rate "
    "limiting is on, and beam search expands candidates outside the "
    "one-token-per-step path the limiter charges. Use sampling instead."
)

#: Set by configure_output_rate() in the process that parsed the options, to
#: the checked configuration (JSON); processes it spawns that build their own
#: config without the options (the API servers of ``--api-server-count N``)
#: take it from there.
ACTIVE_CONFIG_ENV = settings.name("ACTIVE_CONFIG")

_registered = False
#: Whether the feature is on in this process (set by configure_output_rate).
_feature_on = False
#: Why this vLLM cannot run the feature (an unsupported version), if so.
_unsupported: UnsupportedVllmVersion | None = None


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    global _registered, _unsupported
    if _registered:
        return
    _registered = True
    _share_vllm_log_handlers()
    settings.check_legacy_names()
    try:
        check_vllm_version()
    except UnsupportedVllmVersion as exc:
        # Installed beside a vLLM it does not know: vLLM runs as upstream,
        # and only asking for limits fails (with this message).
        _unsupported = exc
        logger.warning("%s Output-rate limits are off; giving their options fails.", exc)
        try:
            _patch_engine_args()
        except Exception:  # an unknown vLLM's EngineArgs: leave it alone
            logger.warning("vllm-output-rate: cannot add its options to this vLLM")
        return
    _patch_engine_args()
    _patch_beam_search()


def _share_vllm_log_handlers() -> None:
    """Log where vLLM logs, at its level: vLLM configures only its own
    ``vllm`` logger (``VLLM_CONFIGURE_LOGGING``), so a plugin's INFO lines
    (limits on, limits reloaded) would otherwise be dropped."""
    ours = logging.getLogger("vllm_output_rate")
    if ours.handlers:
        return
    upstream = logging.getLogger("vllm")
    for handler in upstream.handlers:
        if type(handler) is logging.StreamHandler:  # vLLM's own, not a capture
            mine = logging.StreamHandler(handler.stream)
            mine.setFormatter(handler.formatter)
            ours.addHandler(mine)
            ours.setLevel(upstream.level)
            return


# -- options ------------------------------------------------------------------


from vllm_output_rate.options import GROUP_TITLE, add_output_rate_args, config_from_args  # noqa: E402  (re-exported)


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
        config = config_from_args(args)
        feature_on = config is not None or _inherited_config() is not None
        frontend.configure_frontend(frontend.settings_from_args(args), feature_on, args)
        configure_user_label(getattr(args, "output_rate_user_label", None),
                             getattr(args, "output_rate_user_label_salt_file", None), feature_on)
        if config is not None:
            engine_args.additional_config = {
                **(engine_args.additional_config or {}),
                ADDITIONAL_CONFIG_KEY: to_wire(config),
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
            options = _inherited_frontend()
            if options is not None and frontend.current_identity() is None:
                frontend.configure_frontend(options, True)
        if output_rate_on(vllm_config) and settings.get("FORCE_ASYNC_SCHEDULING"):
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


def configure_user_label(mode: Any, salt_file: Any, feature_on: bool) -> None:
    """Check ``--output-rate-user-label`` and its salt file now (start-up
    errors name the option and the value) and hand them to the engine core
    through the environment, as its other settings travel."""
    if not feature_on:
        if mode is not None or salt_file:
            raise OutputRateConfigError(
                f"{user_label.LABEL_OPTION} and {user_label.SALT_OPTION} need limits "
                f"({DEFAULT_OPTION} or {LIMITS_FILE_OPTION})")
        return
    user_label.check_options(mode, salt_file)
    os.environ.update(user_label.child_settings(mode, salt_file))
    user_label.forget()


def _inherited_config() -> dict[str, Any] | None:
    """The configuration a parent process checked, when this process was
    spawned by it (never the one this process set itself)."""
    raw = settings.get("ACTIVE_CONFIG")
    if not raw:
        return None
    try:
        data = json.loads(raw)
        if data["pid"] == os.getpid():
            return None
        return dict(data["config"])
    except (ValueError, KeyError, TypeError):
        raise OutputRateConfigError(f"{ACTIVE_CONFIG_ENV} is malformed: {raw[:200]!r}") from None


def _inherited_frontend() -> dict[str, Any] | None:
    """The identity options the parent process checked (no secrets)."""
    raw = settings.get("ACTIVE_CONFIG")
    try:
        return json.loads(raw).get("frontend") if raw else None
    except (ValueError, AttributeError):
        return None


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
    extra = getattr(vllm_config, "additional_config", None) or {}
    shared = (extra.get(ADDITIONAL_CONFIG_KEY) or {}).get("shared_state")
    if parallel.data_parallel_size > 1 and not shared:
        reasons.append(
            f"--data-parallel-size {parallel.data_parallel_size}: each rank "
            f"would keep its own limiter and give a user one budget per rank "
            f"(give {SHARED_STATE_OPTION} to share the budgets between ranks)"
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
    interval = getattr(vllm_config.scheduler_config, "prefill_schedule_interval", 1)
    if interval > 1:
        reasons.append(
            f"--prefill-schedule-interval {interval}: steps that may not prefill "
            f"(vLLM 0.33 applies it to a single engine) would hold other users' "
            f"first tokens while every running decode is throttled"
        )
    inflight = getattr(vllm_config.scheduler_config, "max_num_inflight_kv_loads", None)
    if inflight:
        reasons.append(
            f"--max-num-inflight-kv-loads {inflight}: async KV loads (vLLM 0.34) "
            f"come from a KV connector, and connectors change the KV lifecycle "
            f"of throttled requests"
        )
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
    config = config_of(vllm_config)
    if config is None:
        return None
    if _unsupported is not None:
        raise _unsupported
    reasons = unsupported_reasons(vllm_config)
    if reasons:
        raise OutputRateConfigError(
            f"{DEFAULT_OPTION} cannot be used with this configuration:\n  - "
            + "\n  - ".join(reasons)
        )
    sched = vllm_config.scheduler_config
    problem = check_shared(config, bool(sched.enable_chunked_prefill))
    if problem:  # (before the engine core loads a model; it checks again)
        raise OutputRateConfigError(f"{SHARED_STATE_OPTION}: {problem}")
    sched.scheduler_cls = ASYNC_SCHEDULER if sched.async_scheduling else SYNC_SCHEDULER
    # Telemetry (or any other observer) gets ready in this process, before
    # the engine core is spawned.
    observers.prepare_observers(vllm_config)
    # Canonical form, so the engine core reads exactly what we checked.
    wire = vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = to_wire(config)
    os.environ.update(settings.child_env(
        ACTIVE_CONFIG=json.dumps({"pid": os.getpid(), "config": wire,
                                  "frontend": frontend.current_options()})))
    _feature_on = True
    frontend.set_config(config)
    if config.limits_file is not None:
        # `kill -HUP` on this process reaches the engine core (which reloads).
        from vllm_output_rate.limits_watch import install_sighup

        install_sighup()
    logger.info(
        "output-rate limits on: default %s tok/s per user, %d override(s), "
        "from %s (sha256 %s), unlisted users: %s, budgets: %s, scheduler %s",
        config.default_rate,
        len(config.user_rates),
        config.limits_file or "the command line",
        config.digest[:12],
        config.unlisted_users,
        "per engine" if config.shared_state is None else
        "shared through " + parse_shared_state(config.shared_state).redacted_url,
        sched.scheduler_cls,
    )
    return config


# -- beam search ----------------------------------------------------------------


def _patch_beam_search() -> None:
    """Refuse beam search, and a malformed user field, with HTTP 400 while
    the feature is on."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    except ImportError:  # pragma: no cover - serving extras missing
        return
    for cls in (ChatCompletionRequest, CompletionRequest, ResponsesRequest):
        upstream_sampling = cls.to_sampling_params
        if not getattr(upstream_sampling, "_output_rate", False):

            def to_sampling_params(self: Any, *args: Any, __up=upstream_sampling, **kw: Any):
                if _feature_on:
                    trusted = frontend.IDENTITY.get()
                    xargs = self.vllm_xargs
                    if trusted is not None:
                        # the gateway's header or the API key decides; the
                        # body field is ignored
                        self.vllm_xargs = {**(xargs or {}), USER_FIELD: trusted,
                                           TRUSTED_FIELD: frontend.IDENTITY_SOURCE.get()}
                    else:
                        if isinstance(xargs, dict) and TRUSTED_FIELD in xargs:
                            # only the server says a user is trusted
                            xargs = {k: v for k, v in xargs.items() if k != TRUSTED_FIELD}
                        # the body decides: the request fields of
                        # --output-rate-user-sources, in order
                        self.vllm_xargs, error = user_from_sources(
                            xargs, getattr(self, "user", None), frontend.user_sources())
                        if error is not None:
                            from vllm.exceptions import VLLMValidationError

                            raise VLLMValidationError(error, parameter="vllm_xargs")
                        # whose RateLimit headers the response gets
                        frontend.note_user(resolve_user(self.vllm_xargs))
                    trace = frontend.TRACE_CONTEXT.get()
                    if trace is not None:
                        # the request's W3C trace context, for the engine's
                        # spans (vLLM carries its own only with its flag)
                        carried = {TRACEPARENT_FIELD: trace[0]}
                        if trace[1]:
                            carried[TRACESTATE_FIELD] = trace[1]
                        self.vllm_xargs = {**(self.vllm_xargs or {}), **carried}
                return __up(self, *args, **kw)

            to_sampling_params._output_rate = True  # type: ignore[attr-defined]
            cls.to_sampling_params = to_sampling_params
        upstream = getattr(cls, "to_beam_search_params", None)  # (not /v1/responses)
        if upstream is None or getattr(upstream, "_output_rate", False):
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
