"""One twin run: vLLM's own scheduler, its KV cache manager, the plugin's
limiter and the project's engine telemetry, advanced by a virtual clock on
a workload (``Twin(config)``, a ``twin.config.TwinConfig``).

A fake executor returns one sampled token per scheduled request per step
(no weights, no forward pass; a request ends at ``max_tokens``) and the
clock moves by the step-time model (``twin.step_time``). With async
scheduling a step is scheduled before the previous one's output is applied,
as vLLM's batch queue does (``common.scheduler_driver.Driver``). When a
step runs nothing while requests wait (every user throttled), the clock
jumps to the earliest of the throttled users' next budget and the next
arrival: the engine loop's idle wait. A workload's limits line rewrites the
run's copy of the limits file at its time and the scheduler's watcher reads
it then.

Outputs in the config's ``out``: ``summary.json`` (``twin.report.SCHEMA``),
``report.md`` with its plots (``plot-*.png``, ``twin.plots``), and with
limits the engine event log ``events.jsonl`` and the Prometheus text
``metrics.txt`` that the real telemetry writes, in virtual time (its
snapshot in ``telemetry/``); the limits file it ran on (``limits.*``).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import random
import shutil
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from vllm_output_rate.telemetry.clock import Clock
from vllm_output_rate.tools.twin.config import TwinConfig, TwinError, TwinLimits, scheduler_options

NS = 1_000_000_000
#: The twin's clock at virtual time 0 (the engine core's monotonic ns).
T0_NS = 1_000_000_000_000
#: The telemetry's export interval, in virtual time.
EXPORT_NS = NS
#: KV blocks without --num-gpu-blocks-override: at least this many, and
#: enough for every sequence at full length (the cache does not bind).
MIN_BLOCKS = 10_000


class TwinClock(Clock):
    """The telemetry's clocks in the twin: the monotonic one is the
    scheduler's virtual clock, the wall clock ``epoch_ns`` at virtual time
    0 and moving with it."""

    def __init__(self, clock: Any, epoch_ns: int) -> None:
        self._clock, self._epoch_ns = clock, epoch_ns

    def monotonic_ns(self) -> int:
        return self._clock()

    def time_ns(self) -> int:
        return self._epoch_ns + self._clock() - T0_NS


@contextmanager
def frozen_heap():
    """What is built before the run (vLLM's modules, the KV cache's block
    pool: a Python object per block) is left out of the garbage collector's
    passes while the twin runs, as vLLM's engine core freezes its heap once
    built (``gc.freeze()``; undone after, as the engine core does when it
    shuts down): the collector's full passes skip the KV cache's blocks
    (65,537 at R=1,024 with the model's full length each)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Twin:
    """One twin run: ``Twin(config)`` builds the scheduler of a
    ``TwinConfig`` (``twin.config``), ``run()`` runs it and writes the
    outputs, returning the summary."""

    def __init__(self, config: TwinConfig) -> None:
        from vllm_output_rate.config import ADDITIONAL_CONFIG_KEY, OutputRateConfig, to_wire
        from vllm_output_rate.tools.common.scheduler_driver import (
            VirtualClock, config_from_engine_args, scheduler_for_config)
        from vllm_output_rate.tools.twin.report import TwinStats

        self.config = config
        self.workload = config.workload
        self.step_model = config.step_time
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        limits = config.limits
        #: the run's own copy of the limits file (the workload rewrites it)
        self.limits_file = self._limits_copy(limits)
        limiter = OutputRateConfig.from_options(
            limits.default_rate, limits.user_rates, self.limits_file, limits.unlisted_users,
            default_prompt=limits.default_prompt_rate, prefill_ahead=limits.prefill_ahead)
        engine_args = copy.copy(config.engine)
        engine_args.additional_config = {
            k: v for k, v in (engine_args.additional_config or {}).items()
            if k != ADDITIONAL_CONFIG_KEY}
        if limiter is not None:
            engine_args.additional_config[ADDITIONAL_CONFIG_KEY] = to_wire(limiter)
        engine_args.skip_tokenizer_init = True
        self.options = scheduler_options(engine_args)
        self.vllm_config = config_from_engine_args(
            engine_args, async_scheduling=bool(engine_args.async_scheduling))
        sched_config = self.vllm_config.scheduler_config
        self.is_async = bool(sched_config.async_scheduling)
        block_size = self.block_size = self.vllm_config.cache_config.block_size
        self.max_model_len = self.vllm_config.model_config.max_model_len
        self._check_workload()
        blocks = engine_args.num_gpu_blocks_override or max(
            MIN_BLOCKS, sched_config.max_num_seqs * (-(-self.max_model_len // block_size)) + 1)
        self.num_blocks = blocks
        self.clock = VirtualClock(T0_NS)
        # the limits file is looked at at the workload's times (check()),
        # never by a polling thread
        self.scheduler = scheduler_for_config(self.vllm_config, num_blocks=blocks,
                                              clock=self.clock, watch_thread=False)
        self.limited = hasattr(self.scheduler, "output_rate")
        self.stats = TwinStats(self.scheduler, config.keep_charges, T0_NS)
        self.admission = config.admission
        self._sizes: dict[str, list] = {}
        self.seed = engine_args.seed or 0  # vLLM's --seed: here it seeds the prompts' token ids
        self.rng = random.Random(self.seed)
        self.vocab = max(self.vllm_config.model_config.get_vocab_size(), 32)

    def _limits_copy(self, limits: TwinLimits) -> str | None:
        """The run's limits file, in its output folder: the given file's
        copy, or the given text."""
        if limits.limits_text is not None:
            copy_path = self.out / "limits.yaml"
            copy_path.write_text(limits.limits_text)
            return str(copy_path)
        src = limits.limits_file
        if not src:
            return None
        copy_path = self.out / ("limits" + (Path(src).suffix or ".yaml"))
        try:
            shutil.copyfile(src, copy_path)
        except OSError as exc:
            raise TwinError(f"--output-rate-limits-file {src}: cannot read it "
                            f"({exc.strerror or exc})") from None
        return str(copy_path)

    def _check_workload(self) -> None:
        wl, limits_file = self.workload, self.limits_file
        for r in wl.requests:
            if r.prompt_tokens + r.max_tokens > self.max_model_len:
                raise TwinError(
                    f"{wl.path}:{r.line}: prompt_tokens + max_tokens = "
                    f"{r.prompt_tokens + r.max_tokens} exceeds the model length "
                    f"{self.max_model_len} (--max-model-len)")
        for change in wl.limits_changes:
            if limits_file is None:
                raise TwinError(f"{wl.path}:{change.line}: limits_file: the run has no limits "
                                f"file to change (give --output-rate-limits-file)")

    # -- the run -------------------------------------------------------------

    def _add(self, req: Any, index: int) -> None:
        from vllm_output_rate.tools.common.scheduler_driver import make_request

        rng, vocab = self.rng, self.vocab
        prompt = [rng.randrange(10, vocab) for _ in range(req.prompt_tokens)]
        req_id = f"twin-{index}-{req.user}"
        # the request arrived at its time in the workload, while a step ran:
        # the engine takes it at a step boundary (its request path later), and its TTFT
        # counts from its arrival, as a client's would
        arrival = T0_NS + round(req.t * NS)
        if self.admission is not None:
            if not self.admission.admit(req_id, req.user, req.prompt_tokens, req.max_tokens,
                                        arrival):
                self.stats.on_refused(req.user)
                return
            self._sizes[req_id] = [req.prompt_tokens, 0]
        request = make_request(req.user, prompt=prompt, max_tokens=req.max_tokens,
                               arrival_time=arrival / NS, block_size=self.block_size,
                               req_id=req_id, priority=req.priority)
        self.stats.on_arrival(req_id, req.user, arrival)
        self.driver.add(request)

    def _change_limits(self, change: Any) -> None:
        path = self.limits_file
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:  # a new inode, as an editor or a ConfigMap update
            f.write(change.content)
        os.replace(tmp, path)
        watcher = self.scheduler.output_rate.watcher
        result = watcher.check()
        if result == "loaded":  # (the watcher stamps a load on the system's wall clock)
            watcher.loaded_unix = self.telemetry_clock.time()
        self.limit_changes.append({"t": change.t, "in_force_t": None, "result": result,
                                   "digest": watcher.digest})

    def _on_update(self, engine_outputs: Any, now: int) -> None:
        self.stats.on_update(engine_outputs, now)
        if self.admission is None:
            return
        sizes = self._sizes
        for eco in engine_outputs.values():
            for o in eco.outputs:
                size = sizes.get(o.request_id)
                if size is None:
                    continue
                size[1] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    del sizes[o.request_id]
                    self.admission.finished(o.request_id, size[0], size[1], now)

    def _idle_until(self, now: int) -> int:
        """Where the clock goes after a step that ran nothing (the engine
        loop's idle wait): the throttled users' next budget or the next
        arrival, whichever is first."""
        targets = []
        if self.limited:
            wake = self.scheduler.output_rate_wake_target_ns()
            if wake is not None:
                targets.append(wake)
        if self.pending:
            targets.append(self.pending[0][0])
        return max(min(targets), now + 1000) if targets else now + 1_000_000

    def run(self) -> dict[str, Any]:
        from collections import deque

        from vllm_output_rate.observers import IdleWait
        from vllm_output_rate.tools.common.scheduler_driver import Driver, attach_telemetry
        from vllm_output_rate.tools.twin.workload import WorkloadRequest

        sched, clock, stats = self.scheduler, self.clock, self.stats
        self.driver = drv = Driver(sched, clock, is_async=self.is_async,
                                   step_ms_of=self.step_model.step_ms_of(sched),
                                   stamp_at_end=True, on_update=self._on_update,
                                   keep_tokens=False)
        # a request reaches the scheduler the step-time model's request path
        # after its arrival (drawn from its spread when the model has one:
        # a stream of its own, so that the prompts stay those of the seed);
        # a limits change is in the file at its time
        path_of = self.step_model.request_path_of(random.Random(f"path-{self.seed}"))
        #: (when the scheduler sees it, ns; the request or limits change)
        self.pending = deque(sorted(
            ((T0_NS + round((e.t + (path_of() if isinstance(e, WorkloadRequest) else 0.0)) * NS),
              e) for e in self.workload.events), key=lambda p: p[0]))
        self.limit_changes: list[dict[str, Any]] = []
        limits_at_start = None
        if self.limited:
            config = sched.output_rate.config
            limits_at_start = {"default": float(config.default_rate),
                               "users": {u: float(r) for u, r in config.user_rates.items()},
                               "source": config.limits_file and Path(config.limits_file).name}
        wall0 = time.perf_counter()
        with ExitStack() as stack:
            stack.enter_context(frozen_heap())
            self.telemetry_clock = TwinClock(clock, time.time_ns())
            tel = None
            if self.limited:
                (self.out / "telemetry").mkdir(exist_ok=True)
                from vllm_output_rate.telemetry.prompt_work import StepCost

                model = self.step_model  # (its own split of step time between users' prompts)
                tel = attach_telemetry(sched, str(self.out / "telemetry"), start_thread=False,
                                       events_path=str(self.out / "events.jsonl"),
                                       clock=self.telemetry_clock,
                                       step_cost=StepCost(model.base_s, model.per_decode_s,
                                                          model.per_prefill_token_s, "twin"))
                (self.out / "events.jsonl").unlink(missing_ok=True)
            next_export = T0_NS + EXPORT_NS
            model_steps = index = 0
            pending = self.pending
            until = self.config.until_s
            until_ns = None if until is None else T0_NS + round(until * NS)
            while True:
                now = clock()
                if until_ns is not None and now >= until_ns:
                    break
                while pending and pending[0][0] <= now:
                    event = pending.popleft()[1]
                    if isinstance(event, WorkloadRequest):
                        self._add(event, index)
                        index += 1
                    else:
                        self._change_limits(event)
                if tel is not None and now >= next_export:
                    tel.export()
                    next_export += EXPORT_NS * max(1, (now - next_export) // EXPORT_NS + 1)
                if not sched.has_requests():
                    drv.flush()
                    if sched.has_requests():
                        continue
                    if not pending:
                        break
                    arrival = pending[0][0]
                    clock.now_ns = max(now, arrival if tel is None else min(next_export, arrival))
                    continue
                out = drv.step()
                if self.limited:
                    record = sched.output_rate.last_step
                    stats.on_step(record)
                    if self.limit_changes and self.limit_changes[-1]["in_force_t"] is None \
                            and sched.output_rate.config.digest == self.limit_changes[-1]["digest"]:
                        self.limit_changes[-1]["in_force_t"] = (record.now_ns - T0_NS) / NS
                if out.total_num_scheduled_tokens:
                    model_steps += 1
                else:
                    target = self._idle_until(now)
                    if tel is not None:
                        target = min(target, max(next_export, now + 1000))
                    clock.now_ns = target
                    if self.limited and sched.output_rate.observer is not None:
                        sched.output_rate.observer.on_idle_wait(IdleWait(
                            (target - now) / NS, sched.output_rate_wake_target_ns(), now,
                            target, "timeout"))
            end_ns = clock()
            stats.finish(end_ns)
            if tel is not None:
                for _ in range(2):  # idle at two exports: the log says nothing is throttled
                    clock.now_ns = max(clock(), next_export)
                    tel.export()
                    next_export += EXPORT_NS
            sched.shutdown()  # closes the watcher and the telemetry (a last export)
        wall_s = time.perf_counter() - wall0
        return self._write(limits_at_start, end_ns, wall_s, drv.steps, model_steps, index)

    def _write(self, limits: Any, end_ns: int, wall_s: float, steps: int, model_steps: int,
               requests: int) -> dict[str, Any]:
        from vllm_output_rate.internals import installed_vllm_version
        from vllm_output_rate.tools.twin.report import SCHEMA, render_report

        cls = type(self.scheduler)
        files = {"summary": "summary.json", "report": "report.md"}
        if self.limited:
            files["events"] = "events.jsonl"
            files["metrics"] = "metrics.txt"
            (self.out / "metrics.txt").write_bytes(metrics_text(self.out / "telemetry"))
        summary = {
            "schema": SCHEMA,
            "run": {
                "scheduler": f"{cls.__module__}.{cls.__qualname__}",
                "upstream_scheduler": not self.limited,
                "vllm_version": installed_vllm_version(),
                "async_scheduling": self.is_async,
                "workload": os.path.basename(self.workload.path),
                "requests": requests, "seed": self.seed,
                "limits": limits, "limits_changes": [
                    {k: c[k] for k in ("t", "in_force_t", "result")} for c in self.limit_changes],
                "step_time": {**self.step_model.to_json(), "is_estimate": self.step_model.is_estimate},
                "virtual_s": round((end_ns - T0_NS) / NS, 6), "wall_s": round(wall_s, 3),
                "until_s": self.config.until_s,
                "steps": steps, "model_steps": model_steps,
                "num_gpu_blocks": self.num_blocks, "options": self.options,
            },
            "users": self.stats.user_summary(),
            "files": files,
        }
        if self.config.plots:
            from vllm_output_rate.tools.twin.plots import run_plots

            summary["plots"] = run_plots(self.stats.timeline(), self.out)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (self.out / "report.md").write_text(render_report(summary))
        return summary


def metrics_text(telemetry_dir: Path) -> bytes:
    """The telemetry's snapshot as ``/metrics`` shows it (Prometheus text)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_output_rate.telemetry.collector import SnapshotCollector

    registry = CollectorRegistry()
    registry.register(SnapshotCollector(str(telemetry_dir)))
    return generate_latest(registry)
