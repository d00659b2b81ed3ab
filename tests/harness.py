"""Test glue: the tiny model in the repository's cache, the scheduler driver
bound to it, and a real OTLP/HTTP receiver."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_output_rate.observers import OutputRateObserver
from vllm_output_rate.tools.common import scheduler_driver
from vllm_output_rate.tools.common.scheduler_driver import (  # noqa: F401  (re-exported)
    EOS_TOKEN,
    SAMPLED_TOKEN,
    Driver,
    VirtualClock,
    attach_telemetry,
    make_request,
    model_output_for,
    scheduled_ids,
)
from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", REPO / ".cache" / "tiny-llama"))


def tiny_model() -> str:
    return str(ensure_tiny_model(TINY_MODEL_DIR))


def limit_at(schedule, x):
    """The limit in force at ``x`` of ``schedule`` = [(from ns, limit), ...]."""
    return [r for start, r in schedule if start <= x][-1]


def limit_integral(schedule, a, b):
    """Tokens the limits of ``schedule`` allow over [a, b] ns (the old limit
    up to a change, the new one after it), without burst."""
    from fractions import Fraction

    points = [a] + [s for s, _ in schedule if a < s <= b] + [b]
    return sum((limit_at(schedule, lo) * Fraction(hi - lo, 1_000_000_000)
                for lo, hi in zip(points, points[1:])), Fraction(0))


def spend_rate(spends: list[tuple[int, int]]) -> float:
    """Tokens per second over (t_ns, tokens) spends in time order, first to
    last: the first step's tokens open the span and are not counted in it."""
    if len(spends) < 2:
        return 0.0
    return (sum(n for _, n in spends) - spends[0][1]) / ((spends[-1][0] - spends[0][0]) / 1e9)


def rate_while_stepping(spends: list[tuple[int, int]], step_times: list[int], limit: float) -> float:
    """``spend_rate`` over the time the engine was stepping: of every gap
    between two consecutive engine steps (any user's) within the user's
    span, only one token's spacing at ``limit`` counts (a longer gap is the
    machine not running the engine: the user could not have been served,
    whatever its budget). A limiter that holds the user back while the
    engine steps keeps its gaps; the exact rate is checked in virtual time."""
    import bisect

    if len(spends) < 2:
        return 0.0
    lo, hi = spends[0][0], spends[-1][0]
    steps = step_times[bisect.bisect_left(step_times, lo):bisect.bisect_right(step_times, hi)]
    spacing_ns = 1e9 / limit
    stalled_ns = sum(max(0.0, b - a - spacing_ns) for a, b in zip(steps, steps[1:]))
    return (sum(n for _, n in spends) - spends[0][1]) / ((hi - lo - stalled_ns) / 1e9)


def second_model() -> str:
    """Another tokenizer (Unigram) and shape: tools are tried on it too."""
    from vllm_output_rate.tools.common.tiny_model import ensure_second_model

    return str(ensure_second_model(TINY_MODEL_DIR.parent / "second-llama"))


def make_vllm_config(limits: dict[str, Any] | None, **kwargs: Any):
    """A VllmConfig for the tiny model; ``limits`` None means feature off."""
    return scheduler_driver.make_vllm_config(limits, model=tiny_model(), **kwargs)


def make_scheduler(limits: dict[str, Any] | None, **kwargs: Any):
    """The scheduler vLLM would build for this config (ours when limited)."""
    return scheduler_driver.make_scheduler(limits, model=tiny_model(), **kwargs)


class StepTap(OutputRateObserver):
    """Calls ``fn`` with every step report, then passes everything on to
    the observer that was attached before (if any)."""

    def __init__(self, fn, inner: OutputRateObserver | None) -> None:
        self.fn, self.inner = fn, inner
        self.limit_changes = []

    def on_request(self, request_id):
        if self.inner is not None:
            self.inner.on_request(request_id)

    def on_step(self, step):
        self.fn(step)
        if self.inner is not None:
            self.inner.on_step(step)

    def on_outputs(self, outputs):
        if self.inner is not None:
            self.inner.on_outputs(outputs)

    def on_aborted(self, aborted, now_ns):
        if self.inner is not None:
            self.inner.on_aborted(aborted, now_ns)

    def on_idle_wait(self, wait):
        if self.inner is not None:
            self.inner.on_idle_wait(wait)

    def on_limits(self, change):
        self.limit_changes.append(change)
        if self.inner is not None:
            self.inner.on_limits(change)

    def close(self):
        if self.inner is not None:
            self.inner.close()


def observe_steps(sched, fn) -> None:
    """``fn(step report)`` after every ``schedule()`` of ``sched``."""
    sched.output_rate.observer = StepTap(fn, sched.output_rate.observer)


class OtlpHttpReceiver:
    """An OTLP/HTTP trace receiver on loopback: decodes every export request
    (protobuf, with the OpenTelemetry proto classes) into (name, attributes),
    and keeps the path each request was sent to and the resource attributes
    it carried."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.spans: list[tuple[str, dict]] = []
        self.paths: list[str] = []
        self.resources: list[dict] = []
        #: (name, version) of each batch's instrumentation scope
        self.scopes: list[tuple[str, str]] = []
        spans, paths, resources, scopes = self.spans, self.paths, self.resources, self.scopes

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                paths.append(self.path)
                for rs in req.resource_spans:
                    resources.append({a.key: a.value.string_value for a in rs.resource.attributes})
                    for ss in rs.scope_spans:
                        scopes.append((ss.scope.name, ss.scope.version))
                        for span in ss.spans:
                            spans.append((span.name, {a.key: a.value for a in span.attributes}))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        #: the base URL (OTEL_EXPORTER_OTLP_ENDPOINT) and the traces URL
        self.base_url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.url = f"{self.base_url}/v1/traces"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def otlp_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as plain Python (arrays as lists)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [otlp_value(v) for v in value.array_value.values]
    return None if kind is None else getattr(value, kind)


class OtlpSpanReceiver(OtlpHttpReceiver):
    """An ``OtlpHttpReceiver`` that also keeps each span whole in
    ``records``: dicts with ``name``, ``trace_id``, ``span_id``,
    ``parent_span_id`` (hex; ``""`` for a root span), ``attributes`` (plain
    values, ``otlp_value``), the ``service`` (its resource's
    ``service.name``) and ``start_ns`` / ``end_ns`` (the span's own times)."""

    def __init__(self) -> None:
        import io

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        super().__init__()
        self.records: list[dict[str, Any]] = []
        records = self.records
        base = self.httpd.RequestHandlerClass

        class Handler(base):  # type: ignore[misc, valid-type]
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes
                                    if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            records.append({
                                "name": span.name, "service": service,
                                "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "attributes": {a.key: otlp_value(a.value) for a in span.attributes},
                                "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                            })
                self.rfile = io.BytesIO(body)  # the base handler reads it again
                super().do_POST()

        self.httpd.RequestHandlerClass = Handler

    def named(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["name"] == name]


def scrape_until(base_url: str, ready, timeout_s: float = 30.0):
    """``/metrics`` of ``base_url`` once ``ready(samples)`` holds (the engine
    exports about once a second; how soon this process gets to look does
    not matter), or the last scrape after ``timeout_s`` (the caller's
    assertion then says what is missing)."""
    import time

    from vllm_output_rate.tools.common.client import scrape_metrics

    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape_metrics(base_url)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.25)


def rewrite_unseen(path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (same length) in ``path`` in place, the
    modification time put back: a change that polling on stat cannot see."""
    st = os.stat(path)
    with open(path, "r+") as f:
        text = f.read().replace(old, new)
        f.seek(0)
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


# -- fleets of real engines ----------------------------------------------------------


def fleet_engines(name: str, args_of, events: list, n: int = 2) -> list:
    """``n`` real CPU engines of the tiny model for a fleet test (not yet
    started): engine ``i`` served with ``args_of(i)``, its event log
    ``events[i]``, its server log ``.cache/logs/NAME-engine-i.log``. Each
    engine's worker on a core of its own: two workers bound to the same
    core stall each other for seconds (OpenMP spin-waits); and OpenMP
    threads that sleep when idle instead of spinning, so the engine cores,
    API servers and the store get the CPU between steps (with spinning
    workers, step-loop stalls of half a second cost 3-4% of a fleet's
    rate; passive: 97.6-100.1% in four runs)."""
    from vllm_output_rate.tools.common.client import Server

    return [Server(tiny_model(), args_of(i), REPO / ".cache" / "logs" / f"{name}-engine-{i}.log",
                   extra_env={"OUTPUT_RATE_TELEMETRY": "1", "OUTPUT_RATE_EVENTS": str(events[i]),
                              "VLLM_CPU_OMP_THREADS_BIND": str(i % 2),
                              "OMP_WAIT_POLICY": "PASSIVE"})
            for i in range(n)]


def start_all(servers: list) -> list[Exception]:
    """Start ``servers`` at once (a thread each); the errors of those that
    did not start (the caller asserts there are none inside the block
    that stops them all)."""
    import threading

    errors: list[Exception] = []

    def start(server) -> None:
        try:
            server.start()
        except Exception as exc:  # returned
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


# -- shared budgets: schedulers sharing one store on one fake clock ---------------------


def shared_schedulers(urls: list[str], clock, is_async: bool, limit: int = 20,
                      user: str = "user-a", streams: int = 2) -> list:
    """One of vLLM's schedulers per store URL (shared-budget mode, the
    lease rounds run by ``run_shared``), ``streams`` long requests of
    ``user`` on each; their drivers."""
    drivers = []
    for url in urls:
        sched = make_scheduler({"default_user_output_tokens_per_second": limit,
                                "shared_state": url}, clock=clock, async_scheduling=is_async)
        drivers.append(Driver(sched, None, is_async=is_async))
        for _ in range(streams):
            sched.add_request(make_request(user, max_tokens=2000))
    return drivers


def run_shared(drivers: list, clock, steps: int, at=None,
               user: str = "user-a") -> list[list[tuple[int, int]]]:
    """``steps`` steps of 10 ms of every driver on ``clock``, each engine's
    lease round every 5 steps (or at once when short of leases) with the
    store's time the fake clock's (so nothing depends on how promptly this
    process runs); ``at(step, now)`` first at each step. Per engine: (now,
    tokens of ``user`` charged)."""
    spends: list[list[tuple[int, int]]] = [[] for _ in drivers]
    for i in range(steps):
        now = clock()
        if at is not None:
            at(i, now)
        for k, drv in enumerate(drivers):
            limiter = drv.scheduler.output_rate.limiter
            if i % 5 == 0 or limiter.starved:
                limiter.thread.tick(now_us=now / 1000)
            drv.step()
            n = sum(1 for u in drv.scheduler.output_rate.last_step.charged.values() if u == user)
            if n:
                spends[k].append((now, n))
        clock.advance_ms(10)
    return spends
