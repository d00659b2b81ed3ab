"""The ``telemetry_faults`` group (full profile): a server per fault (the
OTLP endpoint dead, hung or flapping, the event log or snapshot directory
unwritable, gone or on a full disk, ``/metrics`` scraped hard); the limit
holds, every request completes, drops are counted."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.tools.reliability.cases import DEFAULT_LIMIT, CaseResult, server_args


#: the load of each telemetry-fault run: a user over its limit (4 streams at
#: the default limit) and a single stream of another user
FAULT_LOAD = (("tf-over", 4, 100), ("tf-single", 1, 60))


#: concurrent scrapers of ``/metrics`` in the scrape case
SCRAPERS = 5


def _histogram_quantile(samples: dict, name: str, q: float) -> float | None:
    """The ``q`` quantile (upper bucket bound) of histogram ``name``, summed
    over its label sets."""
    buckets: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == name + "_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    for le in bounds:
        if buckets[le] >= q * total:
            return le
    return bounds[-1]


class _SilentServer:
    """Accepts TCP connections and never answers (a hung collector)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[Any] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


class _FlappingCollector:
    """An OTLP/HTTP receiver that comes and goes: its port answers (HTTP
    200) for ``period_s``, then is closed for ``period_s``, and so on."""

    def __init__(self, period_s: float = 2.0) -> None:
        import threading

        from vllm_output_rate.tools.common.client import free_port

        self.port = free_port()
        self.period_s = period_s
        self.received = 0
        self.up_periods = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.received += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        while not self._stop.is_set():
            try:
                server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
            except OSError:  # the port not free again yet: down a while longer
                self._stop.wait(0.2)
                continue
            serving = threading.Thread(target=server.serve_forever, daemon=True)
            serving.start()
            self._stop.wait(self.period_s)
            server.shutdown()
            server.server_close()
            self.up_periods += 1
            self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class _FullDisk:
    """A 64 KiB tmpfs mounted on a fresh directory and filled up: writes
    there fail with ENOSPC, as on a full disk. Needs the right to mount
    (root); ``error`` says why not otherwise."""

    def __init__(self) -> None:
        import subprocess

        self.path = Path(tempfile.mkdtemp(prefix="output-rate-full-"))
        self.error: str | None = None
        self.mounted = False
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            self.error = f"could not mount a tmpfs: {(done.stderr or done.stdout).strip()[:200]}"
            return
        self.mounted = True
        try:
            with open(self.path / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass  # full

    def close(self) -> None:
        import shutil
        import subprocess

        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


def _fault_run(model: str, log_dir: Path, name: str, env: dict[str, str], expects: str,
               drop_reason: str | None = None, log_line: str | None = None,
               scrape_hz: float = 0.0, before_load: Callable[[], None] | None = None,
               after: Callable[[], tuple[bool, str]] | None = None) -> CaseResult:
    """One server with ``env``; ``FAULT_LOAD`` against it (and ``/metrics``
    scraped ``scrape_hz`` times a second meanwhile); the limit held
    (the GCRA bound over the window from sending to the last chunk), every
    request complete, no 5xx, the drop counted or logged once."""
    import threading

    from vllm_output_rate.tools.common.client import Server, run_load, summarize
    from vllm_output_rate.tools.common.client import scrape_metrics as scrape

    sends = ", ".join(f"{u} {k} stream(s) x {n} tokens" for u, k, n in FAULT_LOAD) + \
        (f"; /metrics scraped {scrape_hz:g}/s" if scrape_hz else "")
    case = CaseResult("telemetry_faults", name, sends, expects)
    t0 = time.perf_counter()
    log = log_dir / ("stress-fault-" + "".join(c if c.isalnum() else "-" for c in name) + ".log")
    try:
        with Server(model, server_args(), log, extra_env={"OUTPUT_RATE_TELEMETRY": "1", **env}) as server:
            scrapes = {"ok": 0, "bad": 0}
            stop = threading.Event()

            def scraper() -> None:  # one of SCRAPERS, each at scrape_hz / SCRAPERS
                with httpx.Client(timeout=10) as client:
                    while not stop.wait(SCRAPERS / scrape_hz):
                        try:
                            ok = client.get(f"{server.base_url}/metrics").status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        scrapes["ok" if ok else "bad"] += 1

            sides = [threading.Thread(target=scraper, daemon=True)
                     for _ in range(SCRAPERS if scrape_hz else 0)]
            if before_load is not None:
                before_load()
            load_t0 = time.monotonic()
            for side in sides:
                side.start()
            results = asyncio.run(run_load(server.base_url, list(FAULT_LOAD)))
            load_s = time.monotonic() - load_t0
            stop.set()
            for side in sides:
                side.join()
            # one telemetry export, and the drop this case expects once the
            # engine has exported it (waited for, up to 30 s)
            quiet, deadline = time.monotonic() + 2.5, time.monotonic() + 30
            while True:
                try:
                    samples = scrape(server.base_url)
                except Exception:  # noqa: BLE001 - no engine telemetry: reported
                    samples = {}
                seen = drop_reason is None or any(
                    n == series_name("telemetry_dropped") and dict(ls).get("reason") == drop_reason
                    and v > 0 for (n, ls), v in samples.items())
                if (seen and time.monotonic() >= quiet) or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        text = log.read_text(errors="replace")
    except Exception as exc:  # noqa: BLE001
        case.measured = f"{type(exc).__name__}: {exc}"[:300]
        case.seconds = time.perf_counter() - t0
        return case
    rows = {r.user: r for r in summarize(results, {})}
    over = rows["tf-over"]
    # the bound over the window from sending tf-over's first request to its
    # last chunk: it holds the engine's span of tf-over's tokens however late
    # this process reads them (the exact rate is the scheduler-level tests',
    # in virtual time; a rate read here says how fast the machine was)
    mine = [r for r in results if r.user == "tf-over"]
    window_s = max(r.last or r.started for r in mine) - min(r.started for r in mine)
    held = over.tokens <= (window_s + 0.1) * DEFAULT_LIMIT + 1
    complete = all(r.error is None and r.completion_tokens == r.max_tokens for r in results)
    drops = {dict(ls).get("reason", ""): v for (n, ls), v in samples.items()
             if n == series_name("telemetry_dropped") and v > 0}
    itl99 = _histogram_quantile(samples, "vllm:inter_token_latency_seconds", 0.99)
    late99 = _histogram_quantile(samples, series_name("wake_lateness_seconds", "bucket").removesuffix("_bucket"),
                                 0.99)
    parts = [f"tf-over {over.rate:.1f} tok/s (limit {DEFAULT_LIMIT})",
             f"{sum(r.completion_tokens == r.max_tokens for r in results)}/{len(results)} complete",
             f"drops {drops or 'none'}",
             f"ITL p99 <= {itl99 if itl99 is not None else '?'} s",
             f"wake lateness p99 <= {late99 if late99 is not None else '?'} s"]
    ok = held and complete
    if drop_reason is not None:
        ok = ok and drops.get(drop_reason, 0) > 0
    if log_line is not None:
        count = text.count(log_line)
        parts.append(f"log lines '{log_line}': {count}")
        ok = ok and count == 1
    if scrape_hz:
        parts.append(f"scrapes {scrapes['ok']} ok ({scrapes['ok'] / load_s:.0f}/s), "
                     f"{scrapes['bad']} failed")
        ok = ok and scrapes["bad"] == 0 and scrapes["ok"] > 0
    if after is not None:
        good, seen = after()
        parts.append(seen)
        ok = ok and good
    case.measured = "; ".join(parts)
    case.ok = ok
    case.seconds = time.perf_counter() - t0
    return case


def telemetry_fault_cases(model: str, log_dir: Path) -> list[CaseResult]:
    from vllm_output_rate import settings
    from vllm_output_rate.tools.common.client import free_port

    out = []
    otlp = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"}
    dead = free_port()
    out.append(_fault_run(model, log_dir, "OTLP endpoint dead",
                          {**otlp, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{dead}/v1/traces"},
                          "limit held, every request complete; span exports counted as dropped",
                          drop_reason="trace_export_failed"))
    silent = _SilentServer()
    try:
        out.append(_fault_run(model, log_dir, "OTLP endpoint accepts and never answers",
                              {**otlp, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT":
                               f"http://127.0.0.1:{silent.port}/v1/traces"},
                              "limit held, every request complete; span exports counted as dropped",
                              drop_reason="trace_export_failed"))
    finally:
        silent.close()
    flapping = _FlappingCollector(period_s=2.0)
    try:
        out.append(_fault_run(
            model, log_dir, "OTLP endpoint flapping (2 s up, 2 s down)",
            {**otlp, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{flapping.port}/v1/traces",
             "OTEL_BSP_SCHEDULE_DELAY": "500"},
            "limit held, every request complete; exports while it is down counted as dropped, "
            "exports while it is up delivered",
            drop_reason="trace_export_failed",
            after=lambda: (flapping.received > 0,
                           f"collector up {flapping.up_periods} times, {flapping.received} exports delivered")))
    finally:
        flapping.close()
    for what, setting, reason, line in (
            ("snapshot directory", "TELEMETRY_DIR", None, "output-rate telemetry: writing"),
            ("event log", "EVENTS", "events_write_failed", None)):
        disk = _FullDisk()
        try:
            if disk.error:
                case = CaseResult("telemetry_faults", f"{what} on a full disk", "-", "-")
                case.measured = f"not run: {disk.error}"
                out.append(case)
                continue
            target = str(disk.path) if setting == "TELEMETRY_DIR" else str(disk.path / "events.jsonl")
            out.append(_fault_run(
                model, log_dir, f"{what} on a full disk (ENOSPC)", {settings.name(setting): target},
                "limit held, every request complete; "
                + ("failed snapshots logged once, then only counted" if reason is None
                   else "event-log writes counted as dropped"),
                drop_reason=reason, log_line=line))
        finally:
            disk.close()
    with tempfile.TemporaryDirectory(prefix="output-rate-faults-") as scratch:
        blocker = Path(scratch) / "a-file"
        blocker.write_text("not a directory\n")
        out.append(_fault_run(model, log_dir, "event log unwritable",
                              {settings.name("EVENTS"): str(blocker / "events.jsonl")},
                              "limit held, every request complete; event-log writes counted as dropped",
                              drop_reason="events_write_failed"))
        out.append(_fault_run(model, log_dir, "snapshot directory unwritable at start",
                              {settings.name("TELEMETRY_DIR"): str(blocker / "telemetry")},
                              "limit held, every request complete; telemetry does not start, "
                              "logged once; the limiter runs without it",
                              log_line="output-rate telemetry could not start"))
        snapshots = Path(scratch) / "telemetry"
        snapshots.mkdir()

        def pull_the_directory() -> None:
            snapshots.rename(Path(scratch) / "telemetry-gone")
            snapshots.write_text("no longer a directory\n")

        out.append(_fault_run(model, log_dir, "snapshot directory gone mid-run",
                              {settings.name("TELEMETRY_DIR"): str(snapshots)},
                              "limit held, every request complete; failed snapshots logged once "
                              "(then only counted; /metrics has no fresh engine telemetry)",
                              log_line="output-rate telemetry: writing",
                              before_load=pull_the_directory))
    out.append(_fault_run(model, log_dir, "/metrics scraped by 5 clients aiming at 50/s", {},
                          "limit held, every request complete, every scrape answered",
                          scrape_hz=50.0))
    return out
