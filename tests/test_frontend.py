"""The API-server side: identity rules, the API keys file, the middleware
(driven as vLLM's ASGI app would drive it) and its options."""

from __future__ import annotations

import asyncio
import hashlib
import json
from types import SimpleNamespace

import pytest

from vllm_output_rate import frontend
from vllm_output_rate.config import ANONYMOUS_USER, OutputRateConfigError
from vllm_output_rate.frontend import (
    IDENTITY,
    ApiKeysWatcher,
    Identity,
    OutputRateMiddleware,
    parse_api_keys,
)


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


def keys_file(tmp_path, mapping):
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps({"keys": {sha(k): u for k, u in mapping.items()}}))
    return str(path)


def test_header_identity_and_its_absence():
    ident = Identity(user_header="X-User")
    assert ident.decide({"x-user": "alice"}) == ("alice", None, False)
    assert ident.decide({"x-user": "  "}) == (ANONYMOUS_USER, None, False)
    assert ident.decide({}) == (ANONYMOUS_USER, None, False)
    strict = Identity(user_header="X-User", require_user=True)
    user, refusal, _ = strict.decide({})
    assert user is None and "X-User" in refusal
    assert Identity().decide({"x-user": "alice"}) == (None, None, False)  # body field rules
    long = "u" * 1000
    assert len(ident.decide({"x-user": long})[0]) == 256


def test_api_keys_decide_the_user_and_service_keys_stay_valid(tmp_path):
    ident = Identity(user_header="X-User", api_keys=ApiKeysWatcher(
        keys_file(tmp_path, {"alice-key": "alice"}), start_thread=False),
        service_digests=(sha("svc"),))
    assert ident.decide({"authorization": "Bearer alice-key", "x-user": "mallory"}) == (
        "alice", None, True)
    assert ident.decide({"authorization": "Bearer svc", "x-user": "bob"}) == ("bob", None, False)
    for headers in ({"authorization": "Bearer nope"}, {}, {"authorization": "Basic alice-key"}):
        user, refusal, _ = ident.decide(headers)
        assert user is None and "Unauthorized" in refusal and "alice-key" not in refusal
    assert ident.allowed({"authorization": "Bearer alice-key"})
    assert ident.allowed({"authorization": "Bearer svc"})
    assert not ident.allowed({"authorization": "Bearer nope"}) and not ident.allowed({})
    assert Identity().allowed({})  # a server without keys is open


def test_the_keys_file_reloads(tmp_path):
    path = keys_file(tmp_path, {"k1": "alice"})
    watcher = ApiKeysWatcher(path, start_thread=False)
    ident = Identity(api_keys=watcher)
    assert ident.decide({"authorization": "Bearer k1"})[0] == "alice"
    keys_file(tmp_path, {"k2": "bob"})
    assert watcher.check() == "loaded"
    assert ident.decide({"authorization": "Bearer k1"})[0] is None
    assert ident.decide({"authorization": "Bearer k2"})[0] == "bob"
    (tmp_path / "keys.yaml").write_text("keys: {plain-key: bob}")
    assert watcher.check() == "invalid"
    assert "plain-ke" in watcher.last_error and "plain-key" not in watcher.last_error
    assert ident.decide({"authorization": "Bearer k2"})[0] == "bob"  # unchanged


@pytest.mark.parametrize("text, what", [
    ("[1]", "expected one key 'keys'"),
    ("keys: {abc: alice}", "not a SHA-256"),
    (f"keys: {{{'a' * 64}: ''}}", "expected a user id"),
    (f"keys: {{{'a' * 64}: [x]}}", "expected a user id"),
    ("keys: [", "not valid YAML"),
    ("users: {}", "expected one key 'keys'"),
])
def test_a_bad_keys_file_is_refused_naming_the_file(text, what):
    with pytest.raises(OutputRateConfigError) as err:
        parse_api_keys(text.encode(), "/etc/keys.yaml")
    assert "/etc/keys.yaml" in str(err.value) and what in str(err.value)


def test_options_are_checked_and_the_middleware_added(tmp_path, monkeypatch):
    monkeypatch.setattr(frontend, "_identity", None)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = SimpleNamespace(middleware=[], api_key=["svc"], output_rate_user_header="X-User",
                           output_rate_require_user=True, output_rate_api_keys=None)

    def configure(args, on=True):
        return frontend.configure_frontend(frontend.settings_from_args(args), on, args)

    ident = configure(args)
    assert ident.user_header == "X-User" and ident.service_digests == (sha("svc"),)
    assert args.middleware == [frontend.MIDDLEWARE_PATH] and args.api_key == ["svc"]
    assert "svc" not in json.dumps(frontend.current_options())  # digests only
    configure(args)
    assert args.middleware == [frontend.MIDDLEWARE_PATH]  # once
    with pytest.raises(OutputRateConfigError, match="need limits"):
        configure(args, on=False)
    bad = SimpleNamespace(middleware=[], api_key=None, output_rate_user_header="X User",
                          output_rate_require_user=False, output_rate_api_keys=None)
    with pytest.raises(OutputRateConfigError, match="not an HTTP header name"):
        configure(bad)
    bad.output_rate_user_header, bad.output_rate_require_user = None, True
    with pytest.raises(OutputRateConfigError, match="needs --output-rate-user-header"):
        configure(bad)
    bad.output_rate_require_user, bad.output_rate_api_keys = False, str(tmp_path / "none.yaml")
    with pytest.raises(OutputRateConfigError, match="cannot read"):
        configure(bad)
    # with a keys file, vLLM's own key check is taken over (both kinds checked here)
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    both = SimpleNamespace(middleware=[], api_key=None, output_rate_user_header=None,
                           output_rate_require_user=False,
                           output_rate_api_keys=keys_file(tmp_path, {"k": "alice"}))
    ident = configure(both)
    assert ident.guards and ident.service_digests == (sha("env-key"),)
    import os
    assert "VLLM_API_KEY" not in os.environ and both.api_key is None


def _call(middleware, path, headers=(), method="POST"):
    """One request through the middleware; returns (status, body, identity
    seen by the app, authorization header the app saw)."""
    sent, seen = [], {}

    async def run():
        scope = {"type": "http", "method": method, "path": path, "root_path": "",
                 "query_string": b"", "headers": [(k.encode(), v.encode()) for k, v in headers]}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await middleware(scope, receive, send)

    async def app(scope, receive, send):
        seen["user"] = IDENTITY.get()
        seen["auth"] = dict(scope["headers"]).get(b"authorization")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware.app = app
    asyncio.run(run())
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, body, seen.get("user"), seen.get("auth")


def test_the_middleware_sets_the_identity_for_the_request_only(tmp_path, monkeypatch):
    ident = Identity(user_header="X-User", require_user=True, api_keys=ApiKeysWatcher(
        keys_file(tmp_path, {"alice-key": "alice"}), start_thread=False),
        service_digests=(sha("svc"),), guards=True)
    monkeypatch.setattr(frontend, "_identity", ident)
    mw = OutputRateMiddleware(None)
    status, _, user, auth = _call(mw, "/v1/chat/completions",
                                  [("authorization", "Bearer alice-key")])
    assert (status, user, auth) == (200, "alice", b"Bearer alice-key")
    assert IDENTITY.get() is None
    status, _, user, _ = _call(mw, "/v1/completions",
                               [("authorization", "Bearer svc"), ("x-user", "bob")])
    assert (status, user) == (200, "bob")
    status, body, user, _ = _call(mw, "/v1/completions", [("authorization", "Bearer svc")])
    assert status == 401 and b"X-User" in body and user is None
    status, body, _, _ = _call(mw, "/v1/completions", [("authorization", "Bearer stolen")])
    assert status == 401 and b"stolen" not in body
    # not a guarded path: untouched
    status, _, user, _ = _call(mw, "/health", method="GET")
    assert (status, user) == (200, None)


def test_output_rate_routes_follow_the_key_rules(monkeypatch):
    monkeypatch.setattr(frontend, "_identity", Identity(service_digests=(sha("svc"),)))

    async def echo(rest, query):
        return 200, {"rest": rest, "query": query}

    frontend.register_route("echo-test", echo)
    mw = OutputRateMiddleware(None)
    status, body, _, _ = _call(mw, "/output-rate/echo-test/a%20b", method="GET",
                               headers=[("authorization", "Bearer svc")])
    assert status == 200 and json.loads(body)["rest"] == "a b"
    assert _call(mw, "/output-rate/echo-test", method="GET")[0] == 401
    assert _call(mw, "/output-rate/nothing", method="GET",
                 headers=[("authorization", "Bearer svc")])[0] == 404
    assert _call(mw, "/output-rate/echo-test", method="POST",
                 headers=[("authorization", "Bearer svc")])[0] == 405


def test_sighup_rereads_the_keys_file(tmp_path, monkeypatch):
    import os
    import signal
    import time

    from vllm_output_rate import limits_watch

    monkeypatch.setattr(frontend, "_identity", None)
    args = SimpleNamespace(middleware=[], api_key=None, output_rate_user_header=None,
                           output_rate_require_user=False,
                           output_rate_api_keys=keys_file(tmp_path, {"k1": "alice"}))
    ident = frontend.configure_frontend(frontend.settings_from_args(args), True, args)
    watcher = ident.api_keys
    try:
        assert watcher in limits_watch._watchers
        path = tmp_path / "keys.yaml"
        st = os.stat(path)
        same_size = json.dumps({"keys": {sha("k2"): "alice"}})
        assert len(same_size) == st.st_size
        with open(path, "r+") as f:
            f.write(same_size)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 5
        while ident.decide({"authorization": "Bearer k2"})[0] is None:
            assert time.monotonic() < deadline, "SIGHUP did not re-read the keys"
            time.sleep(0.05)
    finally:
        limits_watch.forget(watcher)
        watcher.close()
        monkeypatch.setattr(frontend, "_identity", None)


@pytest.mark.parametrize("carry", [True, False])
def test_the_middleware_keeps_the_trace_context_for_the_request_only(monkeypatch, carry):
    """With the project's traces on, every request's ``traceparent`` and
    ``tracestate`` are kept for where vLLM builds its sampling parameters,
    whoever the user is (here an untrusted server: the body names it)."""
    monkeypatch.setattr(frontend, "_identity", Identity(carry_trace=carry))
    mw = OutputRateMiddleware(None)
    seen = {}

    async def app(scope, receive, send):
        seen["trace"] = frontend.TRACE_CONTEXT.get()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    async def run(headers):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
                 "query_string": b"", "headers": [(k.encode(), v.encode()) for k, v in headers]}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass

        mw.app = app
        await mw(scope, receive, send)

    asyncio.run(run([("traceparent", parent), ("tracestate", "a=1")]))
    assert seen["trace"] == ((parent, "a=1") if carry else None)
    assert frontend.TRACE_CONTEXT.get() is None
    asyncio.run(run([]))
    assert seen["trace"] is None


def test_configure_carries_traces_exactly_when_they_are_on(monkeypatch):
    monkeypatch.setattr(frontend, "_identity", None)
    args = SimpleNamespace(middleware=[], api_key=None, output_rate_user_header=None,
                           output_rate_require_user=False, output_rate_api_keys=None)
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_TRACES_EXPORTER", "OUTPUT_RATE_TRACES_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert not frontend.configure_frontend(frontend.settings_from_args(args), True, args).carry_trace
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert frontend.configure_frontend(frontend.settings_from_args(args), True, args).carry_trace
