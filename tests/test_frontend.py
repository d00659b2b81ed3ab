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


# -- tenant isolation: who reads what, and the RateLimit headers ----------------------

from dataclasses import replace  # noqa: E402
from fractions import Fraction  # noqa: E402

from vllm_output_rate import access  # noqa: E402
from vllm_output_rate.config import OutputRateConfig  # noqa: E402
from vllm_output_rate.frontend import AdminKeysWatcher  # noqa: E402


@pytest.fixture(autouse=True)
def _own_routes(monkeypatch):
    """Each test registers its routes into a copy (the real ones stay)."""
    monkeypatch.setattr(frontend, "_routes", dict(frontend._routes))


def _tenant_server(tmp_path, mode=None):
    """A server with a service key, an admin keys file and customers' keys."""
    admin = tmp_path / "admin.yaml"
    admin.write_text(json.dumps({"keys": {sha("ops-key"): "oncall"}}))
    return Identity(user_header="X-User", api_keys=ApiKeysWatcher(
        keys_file(tmp_path, {"alice-key": "alice", "bob-key": "bob"}), start_thread=False),
        service_digests=(sha("svc"),), guards=True,
        admin_keys=AdminKeysWatcher(str(admin), start_thread=False), introspection=mode)


def _echo_routes():
    async def users(rest, query):
        return 200, {"users": "list"} if not rest else {"user": rest}

    async def limits(rest, query):
        return 200, {"users": {"alice": 1, "bob": 2}}

    frontend.register_route("users", users)
    frontend.register_route("limits", limits)


def _get(mw, path, key=None, extra=()):
    headers = [("authorization", f"Bearer {key}")] if key else []
    status, body, _, _ = _call(mw, path, [*headers, *extra], method="GET")
    return status, body


@pytest.mark.parametrize("mode, kind, own, name, tail, status, served", [
    ("own", access.TENANT, "alice", "me", "", 200, ("users", "alice")),
    ("own", access.TENANT, "alice", "users", "alice", 200, ("users", "alice")),
    ("own", access.TENANT, "alice", "users", "bob", 403, None),
    ("own", access.TENANT, "alice", "users", "", 403, None),
    ("own", access.TENANT, "alice", "limits", "", 403, None),
    ("own", access.OPERATOR, None, "users", "bob", 200, ("users", "bob")),
    ("own", access.OPERATOR, None, "me", "", 400, None),
    ("own", access.OPERATOR, "bob", "me", "", 200, ("users", "bob")),
    ("own", None, None, "users", "alice", 401, None),
    ("operators", access.TENANT, "alice", "me", "", 403, None),
    ("operators", access.OPERATOR, None, "limits", "", 200, ("limits", "")),
    ("off", access.OPERATOR, None, "limits", "", 404, None),
    ("open", None, None, "users", "", 200, ("users", "")),
    ("open", None, "carol", "me", "", 200, ("users", "carol")),
])
def test_the_read_rule(mode, kind, own, name, tail, status, served):
    read = access.decide_read(mode, kind, own, name, tail)
    assert read.status == status
    if served:
        assert (read.name, read.tail) == served
    else:
        assert "bob" not in read.message and "alice" not in read.message


def test_a_tenant_reads_only_its_own_user(tmp_path, monkeypatch):
    monkeypatch.setattr(frontend, "_identity", _tenant_server(tmp_path))
    _echo_routes()
    mw = OutputRateMiddleware(None)
    assert _get(mw, "/output-rate/me", "alice-key") == (200, json.dumps({"user": "alice"}, indent=1).encode())
    assert _get(mw, "/output-rate/users/alice", "alice-key")[0] == 200
    # the header a tenant sends changes nothing: its key decides
    assert json.loads(_get(mw, "/output-rate/me", "alice-key", [("x-user", "bob")])[1]) == {"user": "alice"}
    for path in ("/output-rate/users/bob", "/output-rate/users/b%6Fb", "/output-rate/users",
                 "/output-rate/users?limit=5", "/output-rate/limits", "/output-rate/users/alice/x",
                 "/output-rate/nothing"):
        status, body = _get(mw, path, "alice-key")
        assert status == 403 and b"bob" not in body and b"alice" not in body, (path, body)
    # operators read everything: a service key and an admin key
    for key in ("svc", "ops-key"):
        assert _get(mw, "/output-rate/users/bob", key) == (200, json.dumps({"user": "bob"}, indent=1).encode())
        assert _get(mw, "/output-rate/users", key)[0] == 200
        assert _get(mw, "/output-rate/limits", key)[0] == 200
    assert json.loads(_get(mw, "/output-rate/me", "svc", [("x-user", "bob")])[1]) == {"user": "bob"}
    assert _get(mw, "/output-rate/me", "ops-key")[0] == 400  # names no user
    assert _get(mw, "/output-rate/users/alice")[0] == 401
    assert _get(mw, "/output-rate/users/alice", "stolen")[0] == 401
    # an admin key is no key for /v1
    assert _call(mw, "/v1/completions", [("authorization", "Bearer ops-key")])[0] == 401


@pytest.mark.parametrize("mode, alice, ops", [("operators", 403, 200), ("off", 404, 404)])
def test_introspection_operators_and_off(tmp_path, monkeypatch, mode, alice, ops):
    monkeypatch.setattr(frontend, "_identity", _tenant_server(tmp_path, mode))
    _echo_routes()
    mw = OutputRateMiddleware(None)
    assert _get(mw, "/output-rate/me", "alice-key")[0] == alice
    assert _get(mw, "/output-rate/users/bob", "ops-key")[0] == ops


def test_a_server_without_keys_stays_open_unless_off():
    assert access.introspection_mode(None, False) == access.OPEN
    assert access.introspection_mode("off", False) == "off"
    assert access.introspection_mode(None, True) == "own"
    for mode in ("own", "operators"):
        with pytest.raises(OutputRateConfigError, match=f"--output-rate-introspection {mode} needs keys"):
            access.introspection_mode(mode, False)
    with pytest.raises(OutputRateConfigError, match="--output-rate-introspection.*'everyone'"):
        access.introspection_mode("everyone", True)


def test_admin_keys_option_checked_reloaded_and_registered_for_sighup(tmp_path, monkeypatch):
    from vllm_output_rate import limits_watch

    monkeypatch.setattr(frontend, "_identity", None)
    admin = tmp_path / "admin.yaml"
    args = SimpleNamespace(middleware=[], api_key=None, output_rate_user_header=None,
                           output_rate_require_user=False,
                           output_rate_api_keys=keys_file(tmp_path, {"alice-key": "alice"}),
                           output_rate_admin_keys=str(admin), output_rate_introspection=None)

    def configure(on=True):
        return frontend.configure_frontend(frontend.settings_from_args(args), on, args)

    with pytest.raises(OutputRateConfigError, match=f"--output-rate-admin-keys {admin}: cannot read"):
        configure()
    admin.write_text("keys: {ops-plain-key: oncall}\n")
    with pytest.raises(OutputRateConfigError) as err:
        configure()
    assert "--output-rate-admin-keys" in str(err.value) and "SHA-256" in str(err.value)
    assert "ops-plain-key" not in str(err.value)
    admin.write_text(json.dumps({"keys": {sha("ops-1"): "oncall"}}))
    ident = configure()
    try:
        assert ident.read_mode() == "own" and ident.admin_keys in limits_watch._watchers
        assert ident.reader({"authorization": "Bearer ops-1"}) == (access.OPERATOR, None)
        admin.write_text(json.dumps({"keys": {sha("ops-2"): "oncall"}}))
        assert ident.admin_keys.check() == "loaded"
        assert ident.reader({"authorization": "Bearer ops-1"}) == (None, None)
        assert ident.reader({"authorization": "Bearer ops-2"})[0] == access.OPERATOR
        assert ident.reader({"authorization": "Bearer alice-key"}) == (access.TENANT, "alice")
    finally:
        frontend.forget_identity()
    assert ident.admin_keys not in limits_watch._watchers
    args.output_rate_introspection = "operators"
    args.output_rate_api_keys = args.output_rate_admin_keys = None
    with pytest.raises(OutputRateConfigError, match="needs keys"):
        configure()
    with pytest.raises(OutputRateConfigError, match="need limits"):
        configure(on=False)


@pytest.mark.parametrize("limit, tier, listed, ready, policy, state", [
    (Fraction(40), None, False, 0.0, '"default";q=40;w=1;qu="output-tokens"', '"default";r=40;t=0'),
    (Fraction(1000), "gold", True, 0.0, '"gold";q=1000;w=1;qu="output-tokens"', '"gold";r=1000;t=0'),
    (Fraction(1, 2), None, True, 0.0, '"user";q=1;w=2;qu="output-tokens"', '"user";r=1;t=0'),
    (Fraction(2), None, True, 1.5, '"user";q=2;w=1;qu="output-tokens"', '"user";r=0;t=2'),
    (Fraction(10), None, True, 0.25, '"user";q=10;w=1;qu="output-tokens"', '"user";r=7;t=1'),
    (Fraction(1, 10), 'we"ird', True, 0.0, '"we\\"ird";q=1;w=10;qu="output-tokens"', '"we\\"ird";r=1;t=0'),
])
def test_ratelimit_header_fields(limit, tier, listed, ready, policy, state):
    headers = dict(access.ratelimit_headers(limit, tier, listed, ready))
    assert headers == {b"ratelimit-policy": policy.encode(), b"ratelimit": state.encode()}
    assert access.limit_fraction(float(limit)) == limit


@pytest.mark.parametrize("prompt, ready, policy, state", [
    (Fraction(4000), 0.0, '"gold-prompt";q=4000;w=1;qu="prompt-tokens"', '"gold-prompt";r=4000;t=0'),
    (Fraction(500), 0.5, '"gold-prompt";q=500;w=1;qu="prompt-tokens"', '"gold-prompt";r=250;t=1'),
    (Fraction(1, 4), 3.0, '"gold-prompt";q=1;w=4;qu="prompt-tokens"', '"gold-prompt";r=0;t=3'),
])
def test_a_prompt_budget_is_a_second_policy(prompt, ready, policy, state):
    """The prompt budget follows the output policy in both fields, named
    after it, in prompt tokens; the output policy is unchanged."""
    headers = dict(access.ratelimit_headers(Fraction(50), "gold", True, 0.0, prompt, ready))
    assert headers == {
        b"ratelimit-policy": f'"gold";q=50;w=1;qu="output-tokens", {policy}'.encode(),
        b"ratelimit": f'"gold";r=50;t=0, {state}'.encode()}


def _complete(mw, headers, note=None, chunks=(b"data: 1\n\n", b"data: [DONE]\n\n"), status=200,
              path="/v1/chat/completions"):
    """A completion through the middleware; the app names the body's user
    (``note``) as vLLM's serving entry does. Returns the response headers."""
    sent = []

    async def app(scope, receive, send):
        if note is not None:
            frontend.note_user(note)
        await send({"type": "http.response.start", "status": status, "headers": [(b"x-app", b"1")]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    async def run():
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
                 "query_string": b"", "headers": [(k.encode(), v.encode()) for k, v in headers]}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        mw.app = app
        await mw(scope, receive, send)

    asyncio.run(run())
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"".join(chunks)
    return dict(sent[0]["headers"])


def test_completion_responses_carry_the_callers_own_limit(tmp_path, monkeypatch):
    config = OutputRateConfig(Fraction(40), {"alice": Fraction(1000), "bob": Fraction(1, 2)},
                              tiers={"gold": Fraction(1000)}, user_tiers={"alice": "gold"})
    monkeypatch.setattr(frontend, "_identity", _tenant_server(tmp_path))
    monkeypatch.setattr(frontend, "_config", config)
    monkeypatch.setattr(frontend, "_self_view", None)
    mw = OutputRateMiddleware(None)
    for chunks in ((b"data: 1\n\n", b"data: [DONE]\n\n"), (b'{"choices": []}',)):  # streamed or not
        got = _complete(mw, [("authorization", "Bearer alice-key")], chunks=chunks)
        assert got[b"ratelimit-policy"] == b'"gold";q=1000;w=1;qu="output-tokens"'
        assert got[b"ratelimit"] == b'"gold";r=1000;t=0' and got[b"x-app"] == b"1"
        assert b"bob" not in b"".join(got.values())
    got = _complete(mw, [("authorization", "Bearer svc"), ("x-user", "bob")], path="/v1/completions")
    assert got[b"ratelimit-policy"] == b'"user";q=1;w=2;qu="output-tokens"'
    # a refused request (401) or an error carries none
    assert b"ratelimit" not in _complete(mw, [("authorization", "Bearer svc")], status=400)
    # not a completion: none
    assert b"ratelimit" not in _complete(mw, [("authorization", "Bearer svc"), ("x-user", "bob")],
                                         path="/v1/models")

    # the body decides (no trusted identity): the serving entry names the user
    monkeypatch.setattr(frontend, "_identity", Identity())
    got = _complete(mw, [], note="carol")
    assert got[b"ratelimit-policy"] == b'"default";q=40;w=1;qu="output-tokens"'

    # the engine's view wins over this process's parse (a reloaded file)
    async def view(user):
        return {"limit": 7.5, "tier": None, "listed": True, "ready_in_s": 0.0, "user": user}

    monkeypatch.setattr(frontend, "_self_view", view)
    got = _complete(mw, [], note="carol")
    assert got[b"ratelimit-policy"] == b'"user";q=15;w=2;qu="output-tokens"'

    # a prompt budget in the engine's view: the second policy (not when unlimited)
    async def prompted(user):
        return {"limit": 50, "tier": "rag", "listed": True, "ready_in_s": 0.0,
                "prompt_rate": 4000.0, "prompt_ready_in_s": 0.25}

    monkeypatch.setattr(frontend, "_self_view", prompted)
    got = _complete(mw, [], note="carol")
    assert got[b"ratelimit-policy"] == (b'"rag";q=50;w=1;qu="output-tokens", '
                                        b'"rag-prompt";q=4000;w=1;qu="prompt-tokens"')
    assert got[b"ratelimit"] == b'"rag";r=50;t=0, "rag-prompt";r=3000;t=1'

    async def unlimited(user):
        return {"limit": 50, "tier": None, "listed": True, "ready_in_s": 0.0,
                "prompt_rate": "unlimited", "prompt_ready_in_s": 0.0}

    monkeypatch.setattr(frontend, "_self_view", unlimited)
    assert b"prompt" not in _complete(mw, [], note="carol")[b"ratelimit-policy"]

    # without an engine's view, this process's limits: the default's prompt budget
    monkeypatch.setattr(frontend, "_self_view", None)
    monkeypatch.setattr(frontend, "_config", replace(config, default_prompt_rate=Fraction(800)))
    got = _complete(mw, [], note="carol")
    assert got[b"ratelimit-policy"] == (b'"default";q=40;w=1;qu="output-tokens", '
                                        b'"default-prompt";q=800;w=1;qu="prompt-tokens"')

    async def broken(user):
        raise RuntimeError("no snapshot")

    monkeypatch.setattr(frontend, "_self_view", broken)
    assert b"ratelimit" not in _complete(mw, [], note="carol")  # served all the same
