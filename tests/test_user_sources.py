"""``--output-rate-user-sources``: which request fields name the user (the
extra argument ``vllm_xargs.output_rate_user``, and when opted in the OpenAI
``user`` field), in order, under the trust rules: a trusted header or API key
decides over every body field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_output_rate import frontend, plugin
from vllm_output_rate.config import ANONYMOUS_USER, MAX_USER_LEN, TRUSTED_FIELD, USER_FIELD, OutputRateConfigError
from vllm_output_rate.request_fields import (
    DEFAULT_USER_SOURCES,
    USER_SOURCES,
    USER_SOURCES_OPTION,
    parse_user_sources,
    resolve_user,
    user_from_sources,
)


@pytest.mark.parametrize("value, sources", [
    (None, ("vllm_xargs",)),
    ("vllm_xargs", ("vllm_xargs",)),
    ("vllm_xargs,user", ("vllm_xargs", "user")),
    (" user , vllm_xargs ", ("user", "vllm_xargs")),
    ("user", ("user",)),
])
def test_the_option_names_request_fields_in_order(value, sources):
    assert parse_user_sources(value) == sources


@pytest.mark.parametrize("value, why", [
    ("", "got ''"),
    (",", "got ','"),
    ("vllm_xargs,", "got 'vllm_xargs,'"),
    ("email", "unknown request field 'email'"),
    ("vllm_xargs,User", "unknown request field 'User'"),
    ("user,user", "named twice"),
])
def test_bad_values_are_refused_naming_the_option_and_value(value, why):
    with pytest.raises(OutputRateConfigError) as err:
        parse_user_sources(value)
    assert str(err.value).startswith(USER_SOURCES_OPTION) and why in str(err.value)
    assert "vllm_xargs, user" in str(err.value)  # what is accepted


def engine_user(xargs, openai_user, sources):
    """The user the engine charges for a request the body decides."""
    carried, error = user_from_sources(xargs, openai_user, sources)
    assert error is None
    return resolve_user(carried)


def test_the_openai_user_field_is_read_only_when_opted_in():
    assert engine_user(None, "lite-user", DEFAULT_USER_SOURCES) == ANONYMOUS_USER
    assert engine_user({USER_FIELD: "x"}, "lite-user", DEFAULT_USER_SOURCES) == "x"
    both = ("vllm_xargs", "user")
    assert engine_user(None, "lite-user", both) == "lite-user"
    assert engine_user({USER_FIELD: "x"}, "lite-user", both) == "x"  # the first source wins
    assert engine_user({USER_FIELD: ""}, "lite-user", both) == "lite-user"  # empty: not given
    assert engine_user({USER_FIELD: "x"}, "lite-user", ("user", "vllm_xargs")) == "lite-user"
    # a field that is not a source is ignored, even when it is the only one
    assert engine_user({USER_FIELD: "x"}, None, ("user",)) == ANONYMOUS_USER
    assert engine_user({USER_FIELD: "x", "other": 1}, "", ("user",)) == ANONYMOUS_USER
    assert engine_user(None, "u" * (MAX_USER_LEN + 5), both) == "u" * MAX_USER_LEN


def test_other_extra_arguments_pass_and_an_untouched_request_stays_as_it_came():
    carried, _ = user_from_sources({"other": 1, USER_FIELD: "x"}, "lite", ("user",))
    assert carried == {"other": 1, USER_FIELD: "lite"}
    assert user_from_sources(None, None, ("vllm_xargs", "user")) == (None, None)
    assert user_from_sources(None, "", ("user",)) == (None, None)


def test_a_malformed_extra_argument_is_refused_only_where_it_is_read():
    bad = {USER_FIELD: ["a", "b"]}
    for sources in (DEFAULT_USER_SOURCES, ("vllm_xargs", "user"), ("user", "vllm_xargs")):
        _, error = user_from_sources(bad, "lite", sources)
        assert error is not None and "output_rate_user must be a string" in error
    carried, error = user_from_sources(bad, "lite", ("user",))
    assert error is None and carried == {USER_FIELD: "lite"}


_value = st.one_of(st.none(), st.just(""), st.text(min_size=1, max_size=8))


@given(xargs_user=_value, openai_user=_value,
       sources=st.permutations(USER_SOURCES).flatmap(
           lambda p: st.integers(1, len(p)).map(lambda n: tuple(p[:n]))))
def test_the_first_source_a_request_fills_decides(xargs_user, openai_user, sources):
    xargs = None if xargs_user is None else {USER_FIELD: xargs_user}
    given_by = {"vllm_xargs": xargs_user, "user": openai_user}
    filled = [given_by[s] for s in sources if given_by[s] not in (None, "")]
    expected = filled[0][:MAX_USER_LEN] if filled else ANONYMOUS_USER
    assert engine_user(xargs, openai_user, sources) == expected


# -- the option on the API server and its trust rules ----------------------------------


def _args(**options):
    base = dict(middleware=[], api_key=None, output_rate_user_header=None,
                output_rate_require_user=False, output_rate_api_keys=None,
                output_rate_user_sources=None)
    return SimpleNamespace(**{**base, **options})


def test_the_api_server_checks_and_keeps_the_option(monkeypatch):
    monkeypatch.setattr(frontend, "_identity", None)
    configure = lambda args, on=True: frontend.configure_frontend(  # noqa: E731
        frontend.settings_from_args(args), on, args)
    assert configure(_args()).user_sources == DEFAULT_USER_SOURCES
    ident = configure(_args(output_rate_user_sources="vllm_xargs,user"))
    assert ident.user_sources == ("vllm_xargs", "user") == frontend.user_sources()
    # what API servers spawned by --api-server-count get (plain data)
    assert frontend.current_options()["user_sources"] == "vllm_xargs,user"
    with pytest.raises(OutputRateConfigError, match=f"{USER_SOURCES_OPTION}: unknown request field 'usr'"):
        configure(_args(output_rate_user_sources="usr"))
    with pytest.raises(OutputRateConfigError, match=f"{USER_SOURCES_OPTION}.* need limits"):
        configure(_args(output_rate_user_sources="user"), on=False)
    with pytest.raises(OutputRateConfigError, match=f"{USER_SOURCES_OPTION}: expected"):
        configure(_args(output_rate_user_sources=""), on=False)


@pytest.mark.parametrize("value, why", [("vllm_xargs,email", "'email'"), ("", "got ''")])
def test_serve_refuses_a_bad_value_at_start_up(monkeypatch, value, why):
    """Through vLLM's serve parser and ``from_cli_args``, as ``serve`` runs
    them before any engine starts."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from harness import tiny_model
    from vllm_output_rate.internals import serve_cli

    monkeypatch.setattr(frontend, "_identity", None)
    plugin.register()
    parser = serve_cli()[0](FlexibleArgumentParser())
    good = parser.parse_args(["--model", tiny_model(), USER_SOURCES_OPTION, "vllm_xargs,user",
                              "--output-rate-default-tokens-per-second", "5"])
    assert good.output_rate_user_sources == "vllm_xargs,user"
    AsyncEngineArgs.from_cli_args(good)
    assert frontend.user_sources() == ("vllm_xargs", "user")
    bad = parser.parse_args(["--model", tiny_model(), USER_SOURCES_OPTION, value,
                             "--output-rate-default-tokens-per-second", "5"])
    with pytest.raises(OutputRateConfigError, match=f"^{USER_SOURCES_OPTION}.*{why}"):
        AsyncEngineArgs.from_cli_args(bad)


def _request(kind, openai_user, xargs):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    body = {"model": "tiny", "user": openai_user, "vllm_xargs": xargs}
    if kind == "chat":
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
        return lambda: req.to_sampling_params(4, {})
    if kind == "responses":  # /v1/responses
        req = ResponsesRequest(input="hi", **body)
        return lambda: req.to_sampling_params(4, {})
    req = CompletionRequest(prompt="hi", **body)
    return lambda: req.to_sampling_params(4)


@pytest.fixture
def opted_in(monkeypatch):
    """This API server reads vllm_xargs then user; limits on."""
    plugin.register()
    monkeypatch.setattr(plugin, "_feature_on", True)
    monkeypatch.setattr(frontend, "_identity", frontend.Identity(user_sources=("vllm_xargs", "user")))


@pytest.mark.parametrize("kind", ["chat", "completion", "responses"])
def test_the_serving_entry_charges_the_openai_user_only_when_opted_in(monkeypatch, kind):
    plugin.register()
    monkeypatch.setattr(plugin, "_feature_on", True)
    monkeypatch.setattr(frontend, "_identity", frontend.Identity())  # the default
    assert resolve_user(_request(kind, "lite-user", None)().extra_args) == ANONYMOUS_USER
    monkeypatch.setattr(frontend, "_identity", frontend.Identity(user_sources=("vllm_xargs", "user")))
    assert _request(kind, "lite-user", None)().extra_args == {USER_FIELD: "lite-user"}
    assert _request(kind, "lite-user", {USER_FIELD: "x"})().extra_args == {USER_FIELD: "x"}
    # feature off: the request goes to vLLM as it came (no extra arguments:
    # None, or the responses entry's own empty dict)
    monkeypatch.setattr(plugin, "_feature_on", False)
    assert not _request(kind, "lite-user", None)().extra_args


@pytest.mark.parametrize("source", ["header", "api_key"])
def test_a_trusted_identity_decides_over_every_body_field(opted_in, source):
    forged = {USER_FIELD: "mallory", TRUSTED_FIELD: "header"}
    user, where = frontend.IDENTITY.set("alice"), frontend.IDENTITY_SOURCE.set(source)
    try:
        params = _request("completion", "mallory-too", dict(forged))()
        plain = _request("chat", "mallory-too", None)()
        responses = _request("responses", "mallory-too", dict(forged))()
    finally:
        frontend.IDENTITY_SOURCE.reset(where)
        frontend.IDENTITY.reset(user)
    assert params.extra_args == {USER_FIELD: "alice", TRUSTED_FIELD: source}
    assert plain.extra_args == {USER_FIELD: "alice", TRUSTED_FIELD: source}
    assert responses.extra_args == {USER_FIELD: "alice", TRUSTED_FIELD: source}
    # without the trusted identity, a client's own claim of trust is removed
    untrusted = _request("completion", "lite-user", dict(forged))().extra_args
    assert untrusted == {USER_FIELD: "mallory"}


def test_the_middleware_puts_a_gateway_header_over_the_openai_user(monkeypatch):
    """Through the ASGI middleware: the header's user is what the serving
    entry sees, whatever the body's ``user`` says."""
    import asyncio

    monkeypatch.setattr(frontend, "_identity", None)
    args = _args(output_rate_user_header="X-User", output_rate_user_sources="user,vllm_xargs")
    frontend.configure_frontend(frontend.settings_from_args(args), True, args)
    plugin.register()
    monkeypatch.setattr(plugin, "_feature_on", True)
    seen = {}

    async def app(scope, receive, send):
        seen["extra"] = _request("completion", "lite-user", None)().extra_args
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def run(headers):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
                 "query_string": b"", "headers": headers}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass

        await frontend.OutputRateMiddleware(app)(scope, receive, send)

    asyncio.run(run([(b"x-user", b"gateway-user")]))
    assert seen["extra"] == {USER_FIELD: "gateway-user", TRUSTED_FIELD: "header"}
    asyncio.run(run([]))  # the header option without the header: the anonymous user
    assert seen["extra"] == {USER_FIELD: ANONYMOUS_USER, TRUSTED_FIELD: "header"}
