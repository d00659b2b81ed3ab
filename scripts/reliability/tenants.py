"""The ``tenants`` group (full profile, a server of its own): tenant
isolation, the threat model of RELIABILITY.md: customers with their own
keys, an operator's admin key, hashed user labels; no customer reads or
spends another's."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from vllm_output_rate.access import ADMIN_KEYS_OPTION
from vllm_output_rate.frontend import API_KEYS_OPTION
from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.user_label import LABEL_OPTION, SALT_OPTION
from vllm_output_rate.tools.reliability.cases import DEFAULT_LIMIT, CaseResult, body_for, server_args

TENANT_SALT = b"stress-tenants-salt-0123456789"
TENANT_KEYS = {"alice": "stress-alice-key", "bob-4e1d77": "stress-bob-key"}
TENANT_ADMIN_KEY = "stress-oncall-key"


def tenant_server_args(scratch: Path) -> list[str]:
    import hashlib

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    (scratch / "keys.json").write_text(json.dumps(
        {"keys": {digest(k): u for u, k in TENANT_KEYS.items()}}))
    (scratch / "admin.json").write_text(json.dumps({"keys": {digest(TENANT_ADMIN_KEY): "oncall"}}))
    (scratch / "salt").write_bytes(TENANT_SALT)
    return [*server_args(), "--output-rate-user-header", "X-User",
            API_KEYS_OPTION, str(scratch / "keys.json"), ADMIN_KEYS_OPTION, str(scratch / "admin.json"),
            LABEL_OPTION, "hashed", SALT_OPTION, str(scratch / "salt")]


async def tenant_cases(base_url: str) -> list[CaseResult]:
    """Alice against bob, each with its own key; the operator's view."""
    from vllm_output_rate.user_label import hashed

    alice, bob = "alice", "bob-4e1d77"
    as_alice = {"Authorization": f"Bearer {TENANT_KEYS[alice]}"}
    as_bob = {"Authorization": f"Bearer {TENANT_KEYS[bob]}"}
    as_ops = {"Authorization": f"Bearer {TENANT_ADMIN_KEY}"}
    cases: list[CaseResult] = []
    seen_by_alice: list[str] = []

    from vllm_output_rate.tools.common.client import http_limits

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=http_limits(None)) as client:
        async def get(path: str, headers: dict[str, str]) -> httpx.Response:
            resp = await client.get(f"{base_url}/output-rate/{path}", headers=headers)
            if headers is as_alice:
                seen_by_alice.append(resp.text + str(resp.headers))
            return resp

        async def complete(headers: dict[str, str], user: str, stream: bool) -> httpx.Response:
            body = body_for(user, max_tokens=4, stream=stream)
            extra = {**headers, "X-User": user}
            if stream:
                async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                                         headers=extra) as resp:
                    text = "".join([chunk async for chunk in resp.aiter_text()])
            else:
                resp = await client.post(f"{base_url}/v1/chat/completions", json=body, headers=extra)
                text = resp.text
            if headers is as_alice:
                seen_by_alice.append(text + str(resp.headers))
            return resp

        async def charged() -> dict[str, float]:
            text = (await client.get(f"{base_url}/metrics")).text
            out = {}
            for user in (alice, bob):
                label = hashed(user, TENANT_SALT)
                out[user] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                if line.startswith(series_name("tokens_charged") + "{")
                                and f'user="{label}"' in line)
            return out

        assert (await complete(as_bob, bob, False)).status_code == 200  # bob has state
        await asyncio.sleep(2.5)  # one engine export

        t0 = time.perf_counter()
        case = CaseResult("tenants", "read its own state",
                          "alice's key: GET /output-rate/me, /output-rate/users/alice",
                          "200, alice's state")
        got = [(await get(p, as_alice)) for p in ("me", f"users/{alice}")]
        case.measured = ", ".join(f"{r.status_code} user={r.json().get('user')}" for r in got)
        case.ok = all(r.status_code == 200 and r.json().get("user") == alice for r in got)
        case.seconds = time.perf_counter() - t0
        cases.append(case)

        t0 = time.perf_counter()
        case = CaseResult("tenants", "read another tenant's state",
                          "alice's key: GET users/bob, users, users?limit=20, limits; then the "
                          "admin key: users/bob",
                          "403 for alice naming no user; 200 for the operator")
        got = [(await get(p, as_alice)) for p in (f"users/{bob}", "users", "users?limit=20", "limits")]
        ops = await get(f"users/{bob}", as_ops)
        case.measured = (", ".join(str(r.status_code) for r in got)
                         + f"; operator {ops.status_code}")
        case.ok = (all(r.status_code == 403 and bob not in r.text for r in got)
                   and ops.status_code == 200 and ops.json().get("user") == bob)
        case.seconds = time.perf_counter() - t0
        cases.append(case)

        t0 = time.perf_counter()
        case = CaseResult("tenants", "be charged to another tenant or spend its budget",
                          "alice's key, body field and X-User naming bob: 4 chat completions "
                          "(streamed and not) of 4 tokens",
                          "16 tokens charged to alice, 0 to bob (engine counters, hashed labels)")
        before = await charged()
        statuses = [(await complete(as_alice, bob, stream)).status_code
                    for stream in (True, False, True, False)]
        await asyncio.sleep(2.5)
        after = await charged()
        delta = {u: after[u] - before[u] for u in after}
        case.measured = f"statuses {statuses}; charged {delta}"
        case.ok = statuses == [200] * 4 and delta == {alice: 16, bob: 0}
        case.seconds = time.perf_counter() - t0
        cases.append(case)

        t0 = time.perf_counter()
        case = CaseResult("tenants", "learn another tenant's id",
                          "every response alice got above (bodies, headers, refusals); /metrics",
                          "bob's id in none; RateLimit-Policy on alice's completions is her own "
                          "default limit; no raw id on /metrics")
        policies = [text for text in seen_by_alice if "ratelimit-policy" in text.lower()]
        metrics = (await client.get(f"{base_url}/metrics")).text
        leaks = [t[:80] for t in seen_by_alice if bob in t]
        own = f'"default";q={DEFAULT_LIMIT};w=1'
        case.measured = (f"{len(seen_by_alice)} responses, {len(leaks)} with bob's id, "
                         f"{sum(own in t for t in policies)}/{len(policies)} with alice's policy; "
                         f"/metrics ids: {[u for u in (alice, bob) if f'{chr(34)}{u}{chr(34)}' in metrics]}")
        case.ok = (not leaks and len(policies) == 4 and all(own in t for t in policies)
                   and f'"{alice}"' not in metrics and f'"{bob}"' not in metrics)
        case.seconds = time.perf_counter() - t0
        cases.append(case)
    return cases


def run_tenant_cases(model: str, log_dir: Path) -> list[CaseResult]:
    from vllm_output_rate.tools.common.client import Server

    with tempfile.TemporaryDirectory(prefix="output-rate-tenants-") as scratch:
        with Server(model, tenant_server_args(Path(scratch)), log_dir / "stress-tenants-server.log",
                    extra_env={"OUTPUT_RATE_TELEMETRY": "1"}) as server:
            return asyncio.run(tenant_cases(server.base_url))
