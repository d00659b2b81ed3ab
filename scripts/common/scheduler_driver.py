"""The virtual engine: vLLM's real scheduler on the CPU, its real KV cache
manager, controlled model outputs (one sampled token per scheduled request),
a virtual clock. No engine process, no model execution.

The what-if twin (``twin``) runs on it, as do the scheduler benchmark
(``bench.scheduler``), the stress runner's scheduler-level cases and the
scheduler-level tests. ``model`` defaults to the tiny generated model.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm_output_rate import settings
from vllm_output_rate.config import USER_FIELD
from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.plugin import configure_output_rate
from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

_OUTPUT_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
SAMPLED_TOKEN = 7  # never EOS (1)
EOS_TOKEN = 1


@contextmanager
def _without_telemetry():
    """Schedulers built here get no engine telemetry from its plugin (no
    snapshot directory, no collector, no exporter thread): the caller
    attaches it when it wants it (``attach_telemetry``). Only while one is
    built: the environment is left as it was (servers started later see
    the caller's own settings)."""
    name = settings.name("TELEMETRY")
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def cpu_platform_without_kernels():
    """vLLM 0.34's CPU platform refuses to configure an x86 engine without
    Triton (its CPU kernels); the driver runs no model, only the scheduler,
    so the check is passed over while the config is built
    (named in ``internals``). A no-op where Triton is there."""
    import vllm.triton_utils as triton_utils

    before = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = before


class VirtualClock:
    """A monotonic ns clock that moves only when told (virtual time)."""

    def __init__(self, start_ns: int = 1_000_000_000_000) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance_ms(self, ms: float) -> None:
        self.now_ns += int(ms * 1_000_000)


def make_vllm_config(
    limits: dict[str, Any] | None,
    *,
    model: str | None = None,
    async_scheduling: bool = False,
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 2048,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    block_size: int = 16,
    max_model_len: int = 2048,
    long_prefill_token_threshold: int = 0,
    scheduler_options: dict[str, Any] | None = None,
):
    """A VllmConfig for the tiny model; ``limits`` None means feature off.
    ``scheduler_options``: further ``SchedulerConfig`` fields by name (those
    of one vLLM version only, such as 0.34's cache-aware admission)."""
    additional = {} if limits is None else {"output_rate": limits}
    args = EngineArgs(
        model=model or str(ensure_tiny_model()),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy=policy,
        block_size=block_size,
        async_scheduling=async_scheduling,
        additional_config=additional,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    if max_num_active_seqs is not None:
        args.max_num_active_seqs = max_num_active_seqs
    return config_from_engine_args(args, async_scheduling=async_scheduling,
                                   scheduler_options=scheduler_options)


def config_from_engine_args(args: EngineArgs, *, async_scheduling: bool = False,
                            scheduler_options: dict[str, Any] | None = None):
    """The VllmConfig of ``args`` (as ``vllm serve`` parsed them: the
    plugin's options already in ``additional_config``), built without the
    engine telemetry and with async scheduling kept where vLLM's CPU
    platform would turn it off."""
    with _without_telemetry(), cpu_platform_without_kernels():
        vllm_config = args.create_engine_config()
    for name, value in (scheduler_options or {}).items():
        if not hasattr(vllm_config.scheduler_config, name):
            raise TypeError(f"this vLLM's SchedulerConfig has no {name!r}")
        setattr(vllm_config.scheduler_config, name, value)
    if async_scheduling and not vllm_config.scheduler_config.async_scheduling:
        # vLLM's CPU platform turns async scheduling off; the scheduler itself
        # runs anywhere, so put it back and pick the classes again.
        vllm_config.scheduler_config.async_scheduling = True
        with _without_telemetry():
            configure_output_rate(vllm_config)
    return vllm_config


def make_scheduler(
    limits: dict[str, Any] | None,
    *,
    num_blocks: int = 10_000,
    clock: VirtualClock | None = None,
    **config_kwargs: Any,
):
    """The scheduler vLLM would build for this config (ours when limited)."""
    return scheduler_for_config(make_vllm_config(limits, **config_kwargs),
                                num_blocks=num_blocks, clock=clock)


def scheduler_for_config(vllm_config, *, num_blocks: int = 10_000,
                         clock: VirtualClock | None = None, watch_thread: bool = True):
    """The scheduler class of ``vllm_config`` over a KV cache of
    ``num_blocks`` blocks (no tensors), as the engine core builds it.
    ``watch_thread=False``: the limits file (and a shared store) are looked
    at only when asked, never from a thread (the twin's virtual time)."""
    block_size = vllm_config.cache_config.block_size
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    if not watch_thread and hasattr(cls, "_orl_watch_thread"):
        cls = _unwatched(cls)
    with _without_telemetry():
        scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=True,
        )
    if clock is not None and hasattr(scheduler, "output_rate"):
        scheduler.output_rate.clock = clock
    return scheduler


@functools.cache
def _unwatched(cls: type) -> type:
    """``cls`` as a host that says no to the watch thread."""
    return type(cls.__name__, (cls,), {"_orl_watch_thread": lambda self: False})


def attach_telemetry(sched, out_dir: str, **kwargs: Any):
    """Engine telemetry observing ``sched``, as the telemetry plugin's
    factory makes it (``kwargs``: ``EngineTelemetry``'s knobs)."""
    from vllm_output_rate.telemetry.engine import EngineTelemetry

    tel = EngineTelemetry(SchedulerView(sched), out_dir, **kwargs)
    sched.output_rate.observer = tel
    return tel


_ids = itertools.count()
init_none_hash(sha256)
_HASHERS: dict[int, Any] = {}


def make_request(
    user: str | None,
    *,
    prompt_len: int = 8,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    prompt: list[int] | None = None,
    block_size: int = 16,
    req_id: str | None = None,
    ignore_eos: bool = True,
) -> Request:
    """A request of ``user`` (None: no user field)."""
    extra = None if user is None else {USER_FIELD: user}
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=None if ignore_eos else [EOS_TOKEN],
        extra_args=extra,
    )
    n = next(_ids)
    tokens = prompt if prompt is not None else [(n * 31 + i) % 1000 + 10 for i in range(prompt_len)]
    hasher = _HASHERS.setdefault(block_size, get_request_block_hasher(block_size, sha256))
    return Request(
        request_id=req_id or f"req-{n}",
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time if arrival_time is not None else time.time() + n * 1e-6,
        priority=priority,
        block_hasher=hasher,
    )


def model_output_for(scheduler, out: SchedulerOutput, token: int = SAMPLED_TOKEN) -> ModelRunnerOutput:
    """What a model runner would return: one token for every sampling request."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        samples = request is not None and not request.is_prefill_chunk
        sampled.append([token] if samples else [])
    if _OUTPUT_HAS_INDEX:  # 0.32, 0.33 (0.34 derives it from req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


@dataclass
class Driver:
    """Steps a scheduler like the engine core does, with a fake clock.

    Sync: schedule, "run", update. Async: schedule step k+1 before the
    output of step k is applied (one batch in flight), as vLLM's batch queue.

    ``step_ms_of`` (optional): the time of each step from its
    ``SchedulerOutput``, instead of the fixed ``step_ms``. ``stamp_at_end``:
    a synchronous step's output is applied after the clock moved by its
    time (when the model would have finished it), not before.
    ``on_update(engine outputs, now_ns)`` sees every update's outputs;
    ``keep_tokens`` False leaves ``tokens``, ``finished`` and ``outputs``
    empty (a long run's memory stays flat: every ``SchedulerOutput`` kept
    holds a list per scheduled request). ``schedule_ns`` and ``update_ns``:
    the wall time spent in the scheduler's ``schedule()`` and
    ``update_from_output()`` (what the twin's speed cannot beat).
    """

    scheduler: Any
    clock: VirtualClock | None = None
    step_ms: float = 10.0
    is_async: bool = False
    #: request id -> list of (step, now_ns) for each delivered token
    tokens: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, str] = field(default_factory=dict)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    steps: int = 0
    step_ms_of: Callable[[SchedulerOutput], float] | None = None
    stamp_at_end: bool = False
    on_update: Callable[[dict, int], None] | None = None
    keep_tokens: bool = True
    schedule_ns: int = 0
    update_ns: int = 0
    _pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = field(default_factory=list)

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        t0 = time.perf_counter_ns()
        out = self.scheduler.schedule()
        self.schedule_ns += time.perf_counter_ns() - t0
        if self.keep_tokens:
            self.outputs.append(out)
        self.steps += 1
        mro = model_output_for(self.scheduler, out)
        self._pending.append((out, mro))
        late = self.stamp_at_end and not self.is_async
        if not late and (not self.is_async or len(self._pending) > 1):
            self._apply(*self._pending.pop(0))
        if self.clock is not None:
            self.clock.advance_ms(self.step_ms if self.step_ms_of is None else self.step_ms_of(out))
        if late:
            self._apply(*self._pending.pop(0))
        return out

    def flush(self) -> None:
        while self._pending:
            self._apply(*self._pending.pop(0))

    def _apply(self, out: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        now = self.clock() if self.clock is not None else 0
        t0 = time.perf_counter_ns()
        engine_outputs = self.scheduler.update_from_output(out, mro)
        self.update_ns += time.perf_counter_ns() - t0
        if self.on_update is not None:
            self.on_update(engine_outputs, now)
        if not self.keep_tokens:
            return
        for eco in engine_outputs.values():
            for o in eco.outputs:
                for _ in o.new_token_ids:
                    self.tokens[o.request_id].append((self.steps, now))
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def run_until_done(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                self.flush()
                if not self.scheduler.has_requests():
                    return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def count(self, req_id: str) -> int:
        return len(self.tokens.get(req_id, ()))


def scheduled_ids(out: SchedulerOutput) -> set[str]:
    return set(out.num_scheduled_tokens)
