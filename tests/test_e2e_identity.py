"""End to end: trusted identity and the read-only endpoints on the real vLLM
CPU engine.

One server with every identity option: the user header (required), vLLM's
own --api-key (a gateway's service key), a keys file mapping API keys to
users (customers), an admin keys file (operators), hashed user labels,
unlisted users sharing one budget, limits from a file, the OpenAI ``user``
field read too (``--output-rate-user-sources vllm_xargs,user``: never over
the header or a key). What is charged to
whom is read from the engine's own counters on /metrics (by each user's
hashed label), and the introspection endpoints are compared with them. The
tenant-isolation tests check who reads what, the RateLimit headers, and
that no response to one customer holds another's id.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time

import httpx
import pytest

from harness import REPO, scrape_until, tiny_model
from vllm_output_rate.tools.common.client import http_limits, Server, metric_value, scrape_metrics
from vllm_output_rate.user_label import PLACEHOLDERS, hashed

pytestmark = pytest.mark.e2e

SERVICE_KEY = "svc-key-for-the-gateway"
ALICE_KEY = "alice-secret-key"
#: another customer, with an id no generated text will contain by chance
BOB, BOB_KEY = "bob-7f3a9c", "bob-secret-key"
ADMIN_KEY = "oncall-admin-key"
SALT = b"salt-of-this-test-server-0123456789"
LIMITS = ("default: 40\ntiers: {gold: 1000}\n"
          f"users: {{user-h: gold, alice: 1000, {BOB}: 500, slowpoke: 2, vip: 100000}}\n")


def label(user):
    """The user's label on /metrics (hashed, --output-rate-user-label hashed)."""
    return user if user in PLACEHOLDERS else hashed(user, SALT)


def svc(user=None):
    headers = {"Authorization": f"Bearer {SERVICE_KEY}"}
    if user is not None:
        headers["X-User"] = user
    return headers


def complete(server, headers, max_tokens=20, body_user="vip"):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens,
            "ignore_eos": True, "vllm_xargs": {"output_rate_user": body_user}}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("identity")
    (tmp / "limits.yaml").write_text(LIMITS)
    keys = {"keys": {hashlib.sha256(ALICE_KEY.encode()).hexdigest(): "alice",
                     hashlib.sha256(BOB_KEY.encode()).hexdigest(): BOB}}
    (tmp / "keys.json").write_text(json.dumps(keys))
    admin = {"keys": {hashlib.sha256(ADMIN_KEY.encode()).hexdigest(): "oncall"}}
    (tmp / "admin.json").write_text(json.dumps(admin))
    (tmp / "salt").write_bytes(SALT)
    srv = Server(tiny_model(), [
        "--max-num-seqs", "64", "--max-model-len", "1024",
        "--output-rate-limits-file", str(tmp / "limits.yaml"),
        "--output-rate-user-header", "X-User", "--output-rate-require-user",
        "--api-key", SERVICE_KEY, "--output-rate-api-keys", str(tmp / "keys.json"),
        "--output-rate-admin-keys", str(tmp / "admin.json"),
        "--output-rate-user-label", "hashed", "--output-rate-user-label-salt-file", str(tmp / "salt"),
        "--output-rate-unlisted-users", "shared",
        "--output-rate-user-sources", "vllm_xargs,user",
    ], REPO / ".cache" / "logs" / "e2e-identity-server.log",
        extra_env={"OUTPUT_RATE_TELEMETRY": "1"})
    srv.limits_path = tmp / "limits.yaml"
    srv.start()
    yield srv
    srv.stop()


#: slowpoke's stream in the introspection test: 2 tok/s, about 7 s
SLOW_TOKENS = 15


def charged(samples, user):
    return metric_value(samples, "vllm_output_rate_tokens_charged_total", user=label(user))


def scrape(server):
    return scrape_metrics(server.base_url)


def introspect(server, path, headers=None):
    return httpx.get(f"{server.base_url}/output-rate/{path}",
                     headers=svc() if headers is None else headers, timeout=30)


def test_the_header_or_the_key_decides_the_user_never_the_body(server):
    before = scrape(server)
    # a gateway (service key) names user-h; the body's "vip" is ignored
    assert complete(server, svc("user-h")).status_code == 200
    # alice's own key: alice, whatever the header or the body say
    headers = {"Authorization": f"Bearer {ALICE_KEY}", "X-User": "mallory"}
    assert complete(server, headers).status_code == 200
    after = scrape_until(server.base_url, lambda s: all(
        charged(s, u) - charged(before, u) >= 20 for u in ("user-h", "alice")))
    got = {u: charged(after, u) - charged(before, u) for u in ("user-h", "alice", "vip")}
    print("\ncharged:", got)
    assert got == {"user-h": 20, "alice": 20, "vip": 0}


def test_the_openai_user_field_never_overrides_the_header_or_the_key(server):
    """This server reads the OpenAI ``user`` field too, but a gateway's
    header and a customer's key decide: a body naming vip (listed, 100000
    tok/s) charges nothing to vip."""
    before = scrape(server)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 7, "ignore_eos": True,
            "user": "vip"}
    for headers in (svc("user-h"), {"Authorization": f"Bearer {ALICE_KEY}", "X-User": "vip"}):
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers,
                          timeout=120)
        assert resp.status_code == 200, resp.text
    # the header's required even when the body names a user
    refused = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=svc(), timeout=120)
    assert refused.status_code == 401 and "X-User" in refused.text
    after = scrape_until(server.base_url, lambda s: all(
        charged(s, u) - charged(before, u) >= 7 for u in ("user-h", "alice")))
    got = {u: charged(after, u) - charged(before, u) for u in ("user-h", "alice", "vip")}
    assert got == {"user-h": 7, "alice": 7, "vip": 0}, got


@pytest.mark.parametrize("headers, why", [
    (svc(), "X-User"),  # the service key without the header: required
    ({"Authorization": "Bearer not-a-listed-key", "X-User": "user-h"}, "API key"),
    ({"X-User": "user-h"}, "API key"),
])
def test_requests_without_a_trusted_identity_get_401(server, headers, why):
    resp = complete(server, headers)
    assert resp.status_code == 401 and why in resp.text, resp.text
    assert "not-a-listed-key" not in resp.text
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_invented_ids_share_one_default_budget(server):
    before = scrape(server)

    async def run():
        async with httpx.AsyncClient(limits=http_limits(None), timeout=120) as client:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
            return await asyncio.gather(*(
                client.post(f"{server.base_url}/v1/completions", json=body,
                            headers=svc(f"rotating-{i}")) for i in range(50)))

    t0 = time.monotonic()
    responses = asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert [r.status_code for r in responses] == [200] * 50
    after = scrape_until(server.base_url, lambda s: charged(
        s, "__unlisted__") - charged(before, "__unlisted__") >= 100)
    unlisted = charged(after, "__unlisted__") - charged(before, "__unlisted__")
    print(f"\n50 invented ids: {unlisted:g} tokens in {elapsed:.2f} s (one budget of 40 tok/s)")
    assert unlisted == 100
    # 100 tokens at 40 tok/s with a 100 ms burst (5 tokens): 95 / 40 s at least
    assert elapsed >= 95 / 40 - 0.05
    state = introspect(server, "users/rotating-7").json()
    assert state["budget_user"] == "__unlisted__" and state["limit"] == 40
    assert state["listed"] is False


def test_introspection_matches_the_metrics(server):
    # limits in force: the file's digest, the tier, every engine agreeing
    limits = introspect(server, "limits").json()
    assert limits["sha256"] == hashlib.sha256(server.limits_path.read_bytes()).hexdigest()
    assert limits["source"] == str(server.limits_path) and limits["agree"] is True
    assert limits["users"]["user-h"] == 1000 and limits["user_tiers"] == {"user-h": "gold"}
    assert limits["default"] == 40 and limits["unlisted_users"] == "shared"
    assert introspect(server, "limits", headers={}).status_code == 401
    alice_key = {"Authorization": f"Bearer {ALICE_KEY}"}
    assert introspect(server, "limits", headers=alice_key).status_code == 403
    samples = scrape(server)
    assert metric_value(samples, "vllm_output_rate_limits_info", sha256=limits["sha256"]) == 1

    # a throttled stream of slowpoke (2 tok/s), looked at while it runs:
    # N tokens take at least (N - 1) / 2 - 0.1 s from the first (the GCRA
    # bound), so an engine export made after the first chunk arrived and
    # before sent + that shows the request running, however late this
    # process or the engine's exporter runs
    n = SLOW_TOKENS

    async def slow_stream(received):
        async with httpx.AsyncClient(limits=http_limits(None), timeout=120) as client:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": n, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", f"{server.base_url}/v1/completions", json=body,
                                     headers=svc("slowpoke")) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        received.append(time.time())

    async def run():
        # stamped before sending and after looking: the window bounds what
        # can have been charged
        sent, sent_unix, received = time.monotonic(), time.time(), []
        task = asyncio.create_task(slow_stream(received))
        while not received and not task.done():
            await asyncio.sleep(0.05)
        first = received[0]
        polls = []  # (asked, s after sending; answered, s after; the export's age then)
        while True:  # the first export after the first chunk arrived
            asked = time.monotonic()
            state = (await asyncio.to_thread(introspect, server, "users/slowpoke")).json()
            polls.append((round(asked - sent, 2), round(time.monotonic() - sent, 2),
                          round(time.time() - state["as_of_unix"], 2)))
            if state["as_of_unix"] > first or task.done():
                break
            await asyncio.sleep(0.2)
        window_s = time.monotonic() - sent
        samples = await asyncio.to_thread(scrape, server)
        await task
        return state, samples, len(received), window_s, sent_unix, first, polls

    for attempt in (1, 2):
        state, during, chunks, window_s, sent_unix, first, polls = asyncio.run(run())
        print(f"\nslowpoke while streaming ({window_s:.2f} s in, the export "
              f"{state['as_of_unix'] - first:+.2f} s after the first chunk):", state)
        earliest_end = sent_unix + (n - 1) / 2 - 0.1
        if first < state["as_of_unix"] < earliest_end:
            break
        # No export seen while it ran: once on CI (two loaded cores) every
        # look for 7.5 s showed an export from before its first token. Said,
        # and tried once more after its tokens left the 10 s window.
        print(f"attempt {attempt}: no export seen while it ran; the looks: {polls}")
        if attempt == 1:
            time.sleep(10.5)
    assert chunks == n
    assert first < state["as_of_unix"] < earliest_end, ("no engine export while it ran", polls)
    assert state["tracked"] and state["running"] == 1 and state["limit"] == 2
    assert state["throttled"] in (0, 1) and 0 <= state["ready_in_s"] <= 0.5
    if state["throttled"]:
        assert state["throttled_kv_blocks"] >= 1
    # at least the first token (charged before it was sent); at most what
    # 2 tok/s (a 100 ms burst) allow over the window
    assert 1 <= state["charged_10s"] <= min(n, math.floor((window_s + 0.1) * 2) + 1)
    assert metric_value(during, "vllm_output_rate_throttled_requests", user=label("slowpoke")) in (0, 1)

    # settled: nothing running, the windowed counts equal the counters'
    # increase (the state of the engine's export after the last step)
    scrape_until(server.base_url, lambda s: charged(s, "slowpoke") >= n)
    deadline = time.monotonic() + 30
    while True:
        states = {user: introspect(server, f"users/{user}").json()
                  for user in ("slowpoke", "user-h", "alice")}
        samples = scrape(server)
        settled = all(st["running"] == st["throttled"] == 0 and st["charged_60s"] == charged(samples, user)
                      for user, st in states.items())
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    for user, state in states.items():
        total = charged(samples, user)
        print(f"{user}: charged_60s {state['charged_60s']}, counter {total:g}")
        assert state["running"] == state["throttled"] == 0
        assert state["charged_60s"] == total
    listing = introspect(server, "users?limit=5").json()
    assert 1 <= len(listing["users"]) <= 5


# -- tenant isolation ------------------------------------------------------------------

ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB_AUTH = {"Authorization": f"Bearer {BOB_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_a_customer_reads_only_its_own_state_and_operators_read_all(server):
    # bob has state the engine knows of
    assert complete(server, BOB_AUTH, max_tokens=5).status_code == 200
    scrape_until(server.base_url, lambda s: charged(s, BOB) >= 5)  # one engine export
    answers = []
    for path in ("me", "users/alice"):
        resp = introspect(server, path, headers=ALICE)
        answers.append(resp)
        assert resp.status_code == 200 and resp.json()["user"] == "alice", resp.text
        assert resp.json()["limit"] == 1000
    for path in (f"users/{BOB}", "users", "users?limit=20", "limits"):
        resp = introspect(server, path, headers=ALICE)
        answers.append(resp)
        assert resp.status_code == 403, (path, resp.text)
    for resp in answers:
        assert BOB not in resp.text and BOB not in str(resp.headers)
    # operators: a service key and an admin key read every user, the list and the limits
    for headers in (svc(), ADMIN):
        state = introspect(server, f"users/{BOB}", headers=headers).json()
        assert state["user"] == BOB and state["limit"] == 500 and state["charged_60s"] == 5
        listing = introspect(server, "users?limit=1000", headers=headers).json()
        assert BOB in [u["user"] for u in listing["users"]]
        assert introspect(server, "limits", headers=headers).json()["users"][BOB] == 500
    assert introspect(server, "me", headers=svc("user-h")).json()["user"] == "user-h"
    # an admin key reads, it does not generate
    assert complete(server, ADMIN).status_code == 401


def _stream(server, headers, path="completions"):
    """A streamed completion (or chat completion): its status, headers, text."""
    body = {"model": "tiny", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "vllm_xargs": {"output_rate_user": BOB}}
    if path == "completions":
        body["prompt"] = "hello there"
    else:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    with httpx.stream("POST", f"{server.base_url}/v1/{path}", json=body, headers=headers,
                      timeout=120) as resp:
        return resp.status_code, resp.headers, "".join(resp.iter_text())


def test_every_completion_carries_the_callers_own_limit_and_nothing_of_others(server):
    """RateLimit-Policy / RateLimit on streamed and whole responses, chat
    and completions; the body naming bob changes neither the user nor the
    headers; no response to alice holds bob's id."""
    texts = []
    whole = complete(server, ALICE, max_tokens=6, body_user=BOB)
    assert whole.status_code == 200
    texts.append(whole.text + str(whole.headers))
    for path in ("completions", "chat/completions"):
        status, headers, text = _stream(server, ALICE, path)
        assert status == 200 and "data: [DONE]" in text
        texts.append(text + str(headers))
        assert headers["ratelimit-policy"] == '"user";q=1000;w=1;qu="output-tokens"'
        assert headers["ratelimit"].startswith('"user";r=') and ";t=" in headers["ratelimit"]
    assert whole.headers["ratelimit-policy"] == '"user";q=1000;w=1;qu="output-tokens"'
    # a gateway's user in a tier; an unlisted user on the shared default budget
    gold = complete(server, svc("user-h"), max_tokens=2)
    assert gold.headers["ratelimit-policy"] == '"gold";q=1000;w=1;qu="output-tokens"'
    unlisted = complete(server, svc("walk-in-customer"), max_tokens=2)
    assert unlisted.headers["ratelimit-policy"] == '"default";q=40;w=1;qu="output-tokens"'
    slow = complete(server, svc("slowpoke"), max_tokens=1).headers
    assert slow["ratelimit-policy"] == '"user";q=2;w=1;qu="output-tokens"'
    for text in texts:
        assert BOB not in text


def test_metrics_show_hashed_user_labels_and_no_id(server):
    before = scrape(server)
    assert complete(server, ALICE, max_tokens=2).status_code == 200
    scrape_until(server.base_url, lambda s: charged(s, "alice") - charged(before, "alice") >= 2)
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert f'user="{label("alice")}"' in text and f'user="{label(BOB)}"' in text
    for user in ("alice", BOB, "user-h", "slowpoke", "vip"):
        assert f'"{user}"' not in text, user
    assert charged(scrape(server), "alice") > 0
