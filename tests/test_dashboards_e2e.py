"""Every dashboard query and recording rule against a real Prometheus that
scraped a real engine.

One tiny-model CPU engine serves a two-user load: user-a is limited to 20
tok/s and opens four streams (throttled throughout), user-b is unlimited
(the default limit is far above what the CPU engine can do) and streams for
the first part of the load, so user-a is alone (idle waits) afterwards. A
Prometheus on loopback scrapes the engine's /metrics every second and
evaluates the project's rule files every second. Then every panel query is
run the way Grafana would (variables filled in) and must return data for
the right users; the over-limit alert must stay quiet while the throttled-KV
expressions return data; the limits alerts stay quiet and the limits in
force (command line) are scraped; the picture command draws from that
Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from harness import REPO, tiny_model
from vllm_output_rate.telemetry.metrics import METRICS
from vllm_output_rate.tools.common.client import Server, free_port, run_load

from vllm_output_rate.dashboards import generate
from vllm_output_rate.dashboards import rules as rule_gen
from vllm_output_rate.dashboards.config import VLLM_METRICS, Config, m
from vllm_output_rate.dashboards.expressions import (
    limit_sets_expr,
    over_limit_expr,
    throttled_kv_share_expr,
)
from vllm_output_rate.dashboards.recording import recording_rules
from vllm_output_rate.limits_watch import RESULTS as LIMITS_RESULTS
from vllm_output_rate.dashboards.promql import render

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make tools)"),
]

LIMITED, FREE = "user-a", "user-b"
USERS = (LIMITED, FREE)
DEFAULT = 100_000
SERVER_ARGS = [
    "--max-num-seqs", "16", "--max-num-active-seqs", "8", "--max-model-len", "1024",
    "--default-user-output-tokens-per-second", str(DEFAULT),
    # user-b is listed at the default so that it has its own metric label from its
    # first token (an unlisted user gets one only once among the most active, and
    # a request keeps the label it had at its first token)
    "--user-output-tokens-per-second", json.dumps({LIMITED: 20, FREE: DEFAULT}),
]
#: user-a: 4 streams x 100 tokens at 20 tok/s (about 20 s); user-b: 2 streams
#: x 900 tokens as fast as the engine goes (a few seconds)
PLAN_LIMITED = [(LIMITED, 4, 100)]
PLAN_FREE = [(FREE, 2, 900)]
#: what Grafana substitutes for $__rate_interval with a 1 s scrape interval
RATE_INTERVAL = "15s"
#: thresholds.yaml, as the generator reads it
CONFIG = Config.load()


class Prometheus:
    """A Prometheus on loopback scraping one target, with the project's rules."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = []
        for path in sorted((REPO / "dashboards").rglob("*.rules.yaml")):
            data = yaml.safe_load(path.read_text())
            for group in data["groups"]:
                group["interval"] = "1s"  # the files' production interval, sped up for the test
            copy = workdir / path.name
            copy.write_text(yaml.safe_dump(data, sort_keys=False))
            rules.append(str(copy))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": rules,
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [target]}]}],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen | None = None

    def start(self) -> Prometheus:
        log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.config}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(120):
            if self.proc.poll() is not None:
                raise RuntimeError((self.workdir / "prometheus.log").read_text()[-3000:])
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("prometheus not ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path: str, **params) -> list[dict]:
        resp = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = resp.json()
        assert body["status"] == "success", (params, body)
        return body["data"]["result"]

    def instant(self, expr: str, at: float) -> list[dict]:
        return self.api("query", query=expr, time=at)

    def range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    server = Server(tiny_model(), SERVER_ARGS, REPO / ".cache" / "logs" / "dashboards-e2e-server.log",
                    extra_env={"OUTPUT_RATE_TELEMETRY": "1"})
    server.start()
    prom = Prometheus(workdir, f"127.0.0.1:{server.port}")
    try:
        prom.start()
        _wait(lambda: prom.instant('up{job="vllm"} == 1', time.time()), "first scrape")
        # user-b's series first (its load can finish within one export: a
        # series that appears with its final count shows no increase to a
        # rate() over the window), then the load
        spacing = f'{m("inter_token_seconds").full_name}_count{{user="{FREE}"}}'
        asyncio.run(run_load(server.base_url, [(FREE, 1, 3)]))
        _wait(lambda: prom.instant(spacing, time.time()), "user-b's first series scraped")

        async def load():
            limited = asyncio.create_task(run_load(server.base_url, PLAN_LIMITED))
            await asyncio.sleep(1.0)  # user-a throttled before user-b arrives
            free = await run_load(server.base_url, PLAN_FREE)
            return await limited + free

        start = time.time()
        results = asyncio.run(load())
        end_load = time.time()
        assert [r.error for r in results if r.error] == []
        assert all(r.completion_tokens == r.max_tokens for r in results)
        # the engine exports every second, Prometheus scrapes and evaluates every second
        charged = m("tokens_charged").full_name
        want = sum(r.completion_tokens for r in results if r.user == LIMITED)
        _wait(lambda: [s for s in prom.instant(f'{charged}{{user="{LIMITED}"}}', time.time())
                       if float(s["value"][1]) >= want], "the load's last tokens scraped")
        time.sleep(3)  # a few more rule evaluations
        yield {"prom": prom, "server": server, "start": start - 5, "end_load": end_load,
               "end": time.time(), "results": results, "workdir": workdir}
    finally:
        prom.stop()
        server.stop()


def _wait(check, what: str, attempts: int = 60) -> None:
    for _ in range(attempts):
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _values(series: dict) -> list[float]:
    if "values" in series:
        return [float(v) for _, v in series["values"]]
    return [float(series["value"][1])]


def _by_user(result: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for series in result:
        user = series["metric"].get("user")
        out.setdefault(user, []).extend(v for v in _values(series) if not math.isnan(v))
    return out


def check(result: list[dict], expect: str, users: tuple[str, ...] = USERS) -> None:
    """``result`` meets the generator's expectation for a target."""
    by_user = _by_user(result)
    values = [v for vs in by_user.values() for v in vs]
    assert result and values, "no data"
    if expect == "users":
        for user in users:
            assert by_user.get(user), f"no data for {user}: {sorted(map(str, by_user))}"
    elif expect == "configured":
        assert by_user.get(LIMITED), f"no data for {LIMITED}"
    elif expect == "throttled":
        if LIMITED in users:
            assert max(by_user.get(LIMITED, [0])) > 0, f"{LIMITED} never throttled"
        for user, vs in by_user.items():
            if user != LIMITED:
                assert not any(v > 0 for v in vs), f"{user} is not limited but shows {max(vs)}"
    elif expect == "positive":
        assert max(values) > 0, "never above 0"
    else:
        assert expect == "data", expect


def _panel_queries():
    for build in generate.DASHBOARDS.values():
        board = build(CONFIG)
        for panel in board.panels:
            for i, target in enumerate(panel.targets):
                marks = ()
                modes = {m.only_in for m in METRICS if m.only_in is not None
                         and m.full_name in target.expr}
                if modes:
                    marks = pytest.mark.skip(reason=f"{', '.join(sorted(modes))} only: the engine "
                                             "here keeps its own budgets and has no ceilings")
                yield pytest.param(panel, target, id=f"{board.uid}/{panel.title[:48]}/{chr(65 + i)}",
                                   marks=marks)


@pytest.mark.parametrize(("panel", "target"), list(_panel_queries()))
def test_panel_query_returns_data_for_the_right_users(stack, panel, target):
    prom = stack["prom"]
    # a repeated panel is drawn once per selected user: query it that way
    selections = [(u,) for u in USERS] if panel.repeat_user else [USERS]
    for users in selections:
        expr = render(target.expr, {"model_name": "tiny", "engine": "0", "user": "|".join(users)},
                      rate_interval=RATE_INTERVAL)
        if target.instant:
            result = prom.instant(expr, stack["end"])
        else:
            result = prom.range(expr, stack["start"], stack["end"])
        try:
            check(result, target.expect, users)
        except AssertionError as exc:
            raise AssertionError(f"{panel.title} [{target.legend}] users={users}: {exc}\n{expr}") from None


def _recording_expectation(name: str) -> str:
    if name.endswith(":bool") or "throttled_kv_cache_ratio" in name:
        return "throttled"
    return "users"


@pytest.mark.parametrize("rule", recording_rules(CONFIG), ids=lambda r: r["record"])
def test_recording_rule_has_data_for_the_right_users(stack, rule):
    prom = stack["prom"]
    result = prom.range(rule["record"], stack["start"], stack["end"])
    check(result, _recording_expectation(rule["record"]))


def test_over_limit_alert_is_quiet_and_throttled_kv_expressions_have_data(stack):
    prom, start, end = stack["prom"], stack["start"], stack["end"]
    alerts = {a.name: a for a in rule_gen.alerts(CONFIG)}
    # the rule as deployed (5m window) and the same bound over a window as long as the load
    assert prom.range(alerts["OutputRateUserOverLimit"].expr, start, end) == []
    assert prom.range(over_limit_expr(CONFIG, "15s"), start, end) == []
    # positive control: were user-a's limit half of what the engine enforces, the
    # same expression would catch it (and only it)
    caught = prom.range(over_limit_expr(CONFIG, "15s", limit_scale=0.5), start, end)
    assert {s["metric"]["user"] for s in caught} == {LIMITED}
    # Prometheus itself evaluated the alert rules: the over-limit alert is not even pending
    active = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    print("\nactive alerts after the load:", [(a["labels"]["alertname"], a["state"]) for a in active])
    assert [a for a in active if a["labels"]["alertname"] == "OutputRateUserOverLimit"] == []
    rules = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    # throttled KV: the alert's expression without its threshold, and per user
    share = prom.range(throttled_kv_share_expr(CONFIG), start, end)
    assert share and max(v for s in share for v in _values(s)) > 0
    per_user = prom.range("engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio", start, end)
    check(per_user, "throttled")
    blocks = prom.range(m("throttled_kv_blocks").full_name, start, end)
    check(blocks, "throttled")


def test_limits_alerts_are_quiet_and_the_limits_in_force_are_scraped(stack):
    """One engine with limits from the command line: no failed reload, one
    set of limits; the digest and every reload result are on /metrics."""
    prom, start, end = stack["prom"], stack["start"], stack["end"]
    alerts = {a.name: a for a in rule_gen.alerts(CONFIG)}
    for name in ("OutputRateLimitsReloadFailed", "OutputRateLimitsDiffer"):
        assert prom.range(alerts[name].expr, start, end) == [], name
    info = prom.instant(m("limits_info").full_name, end)
    assert [s["metric"]["source"] for s in info] == ["command line"], info
    assert len(info[0]["metric"]["sha256"]) == 64, info
    assert prom.instant(limit_sets_expr(CONFIG), end)[0]["value"][1] == "1"
    reloads = prom.instant(m("limits_reloads").full_name, end)
    assert {s["metric"]["result"] for s in reloads} == set(LIMITS_RESULTS), reloads
    assert all(float(s["value"][1]) == 0 for s in reloads), reloads


def test_vllm_metrics_used_by_panels_are_scraped(stack):
    prom = stack["prom"]
    suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}
    missing = [name for name, kind in VLLM_METRICS.items()
               if not prom.instant(f'{{__name__="{name}{suffix[kind]}", model_name="tiny"}}', stack["end"])]
    assert missing == []


def test_picture_command_draws_from_prometheus(stack):
    out = stack["workdir"] / "pictures"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.tools.prom_pictures", "--prometheus", stack["prom"].url,
         "--start", str(stack["start"]), "--end", str(stack["end"]), "--out", str(out),
         "--step", "1s", "--rate-interval", RATE_INTERVAL],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["rate_vs_limit.png", "spacing.png", "throttled_kv.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    summary = (out / "summary.md").read_text()
    for user in USERS:
        assert user in summary
    keep = REPO / ".cache" / "dashboards-e2e-pictures"
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(out, keep)  # for a look after the run
    print(f"\npictures in {keep}\n" + summary)
