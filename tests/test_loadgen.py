"""The load generator: scenario parsing (and its rejects), request bodies, and a
run against a fake OpenAI server (httpx mock transport, no engine)."""

from __future__ import annotations

import asyncio
import copy
import json
from fractions import Fraction

import httpx
import pytest
import yaml

from vllm_output_rate.tools.loadgen import prompts
from vllm_output_rate.tools.loadgen import run as loadgen
from vllm_output_rate.tools.loadgen.scenario import ScenarioError, load_scenario, parse_scenario
from vllm_output_rate.tools.loadgen.run import request_body, run_scenario

MINIMAL = {
    "name": "t",
    "users": {"a": 20, "c": "unlimited"},
    "prompts": {"short": "hi", "long": {"tokens": 50, "seed": 3},
                "shared": {"prefix": "long", "text": "q", "unique": True}},
    "phases": [
        {"name": "one", "streams": [
            {"user": "a", "prompt": "short", "max_tokens": 10, "count": 2},
            {"user": "c", "prompt": "shared", "max_tokens": 5, "cancel_after_tokens": 3},
        ]},
    ],
}


def write(tmp_path, data, name="s.yaml"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


def test_default_scenario_covers_what_verification_asks_for():
    s = load_scenario()
    assert s.users == {"user-a": Fraction(20), "user-b": Fraction(60), "user-c": None}
    streams = [st for p in s.phases for st in p.streams]
    by_user = {u: sum(st.count for st in streams if st.user == u) for u in s.users}
    assert by_user["user-a"] >= 3 and by_user["user-b"] >= 3  # several streams each
    assert any(s.prompts[st.prompt].prefix for st in streams)  # prefix-cache hits
    # long prompts: 400 tokens of the served model's tokenizer
    assert any("tokens:400:" in s.prompts[st.prompt].text for st in streams)
    assert any(st.max_tokens <= 10 for st in streams)  # short answers
    assert any(not st.ignore_eos for st in streams)  # EOS
    assert any(st.cancel_after_tokens for st in streams) and any(st.cancel_after_s for st in streams)
    assert s.checks.baseline_phase == "baseline" and s.checks.compare_phase == "mixed"
    baseline = s.phases[0].streams
    assert {st.user for st in baseline} == {"user-c"}  # the unlimited user alone
    args = s.server_args()
    overrides = json.loads(args[args.index("--output-rate-user-tokens-per-second") + 1])
    assert overrides == {"user-a": 20, "user-b": 60, "user-c": 100000}


def test_yaml_and_json_give_the_same_scenario(tmp_path):
    a = load_scenario(write(tmp_path, MINIMAL, "s.yaml"))
    b = load_scenario(write(tmp_path, MINIMAL, "s.json"))
    assert a.users == b.users and a.phases == b.phases and a.prompts == b.prompts
    assert a.users == {"a": Fraction(20), "c": None}
    assert a.prompts["shared"].text.startswith(a.prompts["long"].text)
    assert a.prompts["shared"].unique and a.prompts["shared"].prefix == "long"
    # sized in tokens of the server's tokenizer: resolved when the run starts
    assert a.prompts["long"].text == "\x00tokens:50:3\x00"
    assert a.expected_tokens() == 2 * 10 + 3


def test_generated_prompts_are_deterministic():
    assert prompts.generated_text(30, 1) == prompts.generated_text(30, 1)
    assert prompts.generated_text(30, 1) != prompts.generated_text(30, 2)


def _mutate(path_fn):
    data = copy.deepcopy(MINIMAL)
    path_fn(data)
    return data


REJECTS = [
    # (mutation, words the message must contain)
    (lambda d: d.pop("users"), ["missing required field 'users'"]),
    (lambda d: d.update(users={}), ["users", "non-empty mapping"]),
    (lambda d: d["users"].update(a=-5), ["users.a", "-5"]),
    (lambda d: d["users"].update(a="fast"), ["users.a", "'fast'", "unlimited"]),
    (lambda d: d["phases"][0]["streams"][0].update(max_token=3),
     ["phases[0].streams[0].max_token", "unknown field"]),
    (lambda d: d["phases"][0]["streams"][0].pop("max_tokens"),
     ["phases[0].streams[0]", "missing required field 'max_tokens'"]),
    (lambda d: d["phases"][0]["streams"][0].update(user="nobody"),
     ["phases[0].streams[0].user", "not declared", "'nobody'"]),
    (lambda d: d["phases"][0]["streams"][0].update(prompt="nope"),
     ["phases[0].streams[0].prompt", "'nope'"]),
    (lambda d: d["phases"][0]["streams"][0].update(max_tokens=0),
     ["phases[0].streams[0].max_tokens", "integer >= 1", "0"]),
    (lambda d: d["phases"][0]["streams"][0].update(count=1.5),
     ["phases[0].streams[0].count", "1.5"]),
    (lambda d: d["phases"][0]["streams"][1].update(cancel_after_tokens=5),
     ["phases[0].streams[1].cancel_after_tokens", "below max_tokens"]),
    (lambda d: d["phases"][0]["streams"][0].update(cancel_after_s=0),
     ["phases[0].streams[0].cancel_after_s", "> 0"]),
    (lambda d: d["phases"][0]["streams"][0].update(start_s=-1),
     ["phases[0].streams[0].start_s", "-1"]),
    (lambda d: d["phases"][0]["streams"][0].update(ignore_eos="no"),
     ["phases[0].streams[0].ignore_eos", "true or false", "'no'"]),
    (lambda d: d["phases"][0]["streams"][0].update(stop_token_ids=[1]),
     ["phases[0].streams[0].stop_token_ids", "ignore_eos: false"]),
    (lambda d: d["phases"].append({"name": "one", "streams": d["phases"][0]["streams"]}),
     ["phases[1].name", "duplicate", "'one'"]),
    (lambda d: d["phases"][0].update(streams=[]), ["phases[0].streams", "non-empty list"]),
    (lambda d: d.update(phases={}), ["phases", "non-empty list"]),
    (lambda d: d["prompts"].update(x={"prefix": "y"}, y={"prefix": "x"}),
     ["prompts.", ".prefix", "cycle"]),
    (lambda d: d["prompts"].update(x={"prefix": "missing"}), ["prompts.x.prefix", "'missing'"]),
    (lambda d: d["prompts"].update(x={"text": "a", "tokens": 3}), ["prompts.x", "either text or tokens"]),
    (lambda d: d["prompts"].update(x=""), ["prompts.x", "must not be empty"]),
    (lambda d: d.update(server={"args": ["--user-output-tokens-per-second", "{}"]}),
     ["server.args", "limits come from users"]),
    (lambda d: d.update(server={"args": ["--output-rate-default-tokens-per-second=5"]}),
     ["server.args", "limits come from users"]),
    (lambda d: d.update(server={"default_limit": 0}), ["server.default_limit", "0"]),
    (lambda d: d.update(checks={"baseline_phase": "zzz", "compare_phase": "one"}),
     ["checks.baseline_phase", "'zzz'"]),
    (lambda d: d.update(checks={"baseline_phase": "one"}), ["checks", "go together"]),
    (lambda d: d.update(checks={"stall_extra_s": -1}), ["checks.stall_extra_s", ">= 0", "-1"]),
    (lambda d: d.update(timeout_s=0), ["timeout_s", "> 0"]),
    (lambda d: d.update(colour="red"), ["colour", "unknown field"]),
]


@pytest.mark.parametrize("mutation,words", REJECTS)
def test_bad_scenarios_are_rejected_naming_file_field_and_value(tmp_path, mutation, words):
    path = write(tmp_path, _mutate(mutation))
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    msg = str(err.value)
    assert msg.startswith(str(path) + ": "), msg
    for w in words:
        assert w in msg, (w, msg)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("users: [a, b\n")
    with pytest.raises(ScenarioError, match=r"bad\.yaml: not valid YAML"):
        load_scenario(bad)
    badj = tmp_path / "bad.json"
    badj.write_text("{users: 1}")
    with pytest.raises(ScenarioError, match=r"bad\.json: not valid JSON"):
        load_scenario(badj)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ScenarioError, match="expected a mapping"):
        load_scenario(top)


def test_the_cli_reports_a_bad_scenario_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, _mutate(lambda d: d["users"].update(a="fast")))
    assert loadgen.main(["--server", "http://127.0.0.1:9", "--scenario", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "users.a" in err


def test_request_body():
    s = parse_scenario(copy.deepcopy(MINIMAL))
    spec = s.phases[0].streams[0]
    body = request_body(s, spec, "hello")
    assert body["vllm_xargs"] == {"output_rate_user": "a"}
    assert body["max_tokens"] == 10 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stop_token_ids" not in body
    d = copy.deepcopy(MINIMAL)
    d["users"]["__anonymous__"] = 5
    d["phases"][0]["streams"][0].update(user="__anonymous__", ignore_eos=False,
                                        stop_token_ids=[1, 2], temperature=0)
    s2 = parse_scenario(d)
    body = request_body(s2, s2.phases[0].streams[0], "x")
    assert "vllm_xargs" not in body  # the anonymous user sends no user field
    assert body["stop_token_ids"] == [1, 2] and body["ignore_eos"] is False
    assert body["temperature"] == 0


# --------------------------------------------------------------------------- fake server


class _AsyncStream(httpx.AsyncByteStream):
    def __init__(self, gen):
        self.gen = gen

    def __aiter__(self):
        return self.gen.__aiter__()

    async def aclose(self):
        await self.gen.aclose()


class WordTokenizer:
    """vLLM's /tokenize and /detokenize for the fake servers: one token per
    word (ids handed out as words come)."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def answer(self, request: httpx.Request) -> httpx.Response | None:
        path = request.url.path
        if path not in ("/tokenize", "/detokenize"):
            return None
        body = json.loads(request.content)
        if path == "/tokenize":
            ids = [self.ids.setdefault(w, len(self.ids)) for w in body["prompt"].split()]
            self.words = sorted(self.ids, key=self.ids.get)
            return httpx.Response(200, json={"tokens": ids, "count": len(ids)})
        return httpx.Response(200, json={"prompt": " ".join(self.words[i] for i in body["tokens"])})


def with_tokenizer(handler):
    """``handler`` behind a word tokenizer (async or plain handlers)."""
    tokenizer = WordTokenizer()

    async def both(request: httpx.Request) -> httpx.Response:
        answer = tokenizer.answer(request)
        if answer is not None:
            return answer
        response = handler(request)
        return await response if asyncio.iscoroutine(response) else response

    return httpx.MockTransport(both)


def fake_server(tokens_per_chunk=1, delay_s=0.0, finish_at=None, log=None):
    """An OpenAI-like streaming endpoint: one chunk per token with continuous
    usage (and a word tokenizer)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if log is not None:
            log.append((request.headers.get("x-request-id"), body))
        eos = finish_at is not None and not body["ignore_eos"]
        n = min(finish_at, body["max_tokens"]) if eos else body["max_tokens"]
        reason = "length" if n == body["max_tokens"] else "stop"

        async def stream():
            for i in range(1, n + 1):
                if delay_s:
                    await asyncio.sleep(delay_s)
                chunk = {"id": "x", "choices": [{"index": 0, "delta": {"content": "t"},
                                                 "finish_reason": reason if i == n else None}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": i}}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, stream=_AsyncStream(stream()),
                              headers={"content-type": "text/event-stream"})

    return with_tokenizer(handler)


def test_run_records_every_chunk_and_cancels_after_n_tokens():
    s = parse_scenario(copy.deepcopy(MINIMAL))
    log = []
    run = asyncio.run(run_scenario("http://fake", s, run_id="r1", transport=fake_server(log=log)))
    assert [r.rid for r in run.requests] == ["orl-r1-0000", "orl-r1-0001", "orl-r1-0002"]
    assert sorted(h for h, _ in log) == ["orl-r1-0000", "orl-r1-0001", "orl-r1-0002"]
    a0, a1, c = run.requests
    assert a0.user == "a" and a0.completion_tokens == 10 and a0.finish_reason == "length"
    assert [n for _, n in a0.chunks] == list(range(1, 11)) and a0.prompt_tokens == 7
    assert not a0.cancelled and a0.error is None
    assert c.cancelled and c.completion_tokens == 3 and c.finish_reason is None
    bodies = {h: b for h, b in log}
    # the shared-prefix prompt is made unique per request after its prefix;
    # the long prompt is exactly its tokens of the server's tokenizer
    text = bodies["orl-r1-0002"]["messages"][0]["content"]
    long_text, _, rest = text.partition("\n")
    assert len(long_text.split()) == 50 and "\x00" not in text
    assert rest == "q [request 2]"
    assert set(run.phases) == {"one"}
    again = loadgen.RunRecord.from_json(json.loads(json.dumps(run.to_json())))
    assert again.requests[0].chunks == a0.chunks


def test_early_stop_and_cancel_after_seconds():
    d = copy.deepcopy(MINIMAL)
    d["phases"][0]["streams"] = [
        {"user": "a", "prompt": "short", "max_tokens": 50, "ignore_eos": False},
        {"user": "a", "prompt": "short", "max_tokens": 10_000, "cancel_after_s": 0.3},
    ]
    s = parse_scenario(d)
    run = asyncio.run(run_scenario("http://fake", s, transport=fake_server(finish_at=20,
                                                                         delay_s=0.002)))
    stop, cut = run.requests
    assert stop.finish_reason == "stop" and stop.completion_tokens == 20 and not stop.cancelled
    assert cut.cancelled and cut.error is None and 0 < cut.completion_tokens < 10_000


def test_the_run_stops_by_itself_at_its_timeout():
    d = copy.deepcopy(MINIMAL)
    d["timeout_s"] = 0.3
    d["phases"][0]["streams"] = [{"user": "a", "prompt": "short", "max_tokens": 10_000}]
    s = parse_scenario(d)
    run = asyncio.run(run_scenario("http://fake", s, transport=fake_server(delay_s=0.01)))
    assert run.timed_out
    assert run.requests[0].error and "timeout" in run.requests[0].error


def test_http_errors_are_recorded_not_raised():
    s = parse_scenario(copy.deepcopy(MINIMAL))
    transport = with_tokenizer(lambda req: httpx.Response(400, text="beam search refused"))
    run = asyncio.run(run_scenario("http://fake", s, transport=transport))
    assert all(r.error and r.error.startswith("HTTP 400") for r in run.requests)


def error_mid_stream(tokens=2):
    """HTTP 200, a few chunks, then vLLM's error payload and [DONE]."""

    async def handler(request: httpx.Request) -> httpx.Response:
        async def stream():
            yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}], ' \
                  b'"usage": {"prompt_tokens": 7, "completion_tokens": 0}}\n\n'
            for i in range(1, tokens + 1):
                chunk = {"choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": i}}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                               "param": None, "code": 500}}
            yield f"data: {json.dumps(error)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, stream=_AsyncStream(stream()),
                              headers={"content-type": "text/event-stream"})

    return with_tokenizer(handler)


def test_an_error_inside_a_200_stream_is_an_error():
    s = parse_scenario(copy.deepcopy(MINIMAL))
    run = asyncio.run(run_scenario("http://fake", s, transport=error_mid_stream()))
    for r in run.requests:
        assert r.error and "Internal server error" in r.error
        assert r.completion_tokens == 2 and r.finish_reason is None and not r.cancelled


def test_the_client_records_streams_with_the_same_loop():
    from vllm_output_rate.tools.common.client import stream_chat

    async def one(transport, **kw):
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_chat(client, "http://fake", "tiny", "a", 5, **kw)

    seen = []
    ok = asyncio.run(one(fake_server(), on_tokens=seen.append))
    assert ok.error is None and ok.finish_reason == "length" and ok.completion_tokens == 5
    assert [n for _, n in ok.chunks] == [1, 2, 3, 4, 5] and sum(seen) == 5 and ok.prompt_tokens == 7
    bad = asyncio.run(one(error_mid_stream()))
    assert bad.error and "Internal server error" in bad.error
    # the first chunk is kept even without tokens (its arrival), then one per new token
    assert [n for _, n in bad.chunks] == [0, 1, 2] and bad.completion_tokens == 2
    refused = asyncio.run(one(httpx.MockTransport(lambda req: httpx.Response(400, text="no"))))
    assert refused.error == "HTTP 400: no"


def test_a_server_started_from_here_makes_its_own_telemetry_and_limits(monkeypatch, tmp_path):
    """A process that configured an engine itself (a test, a notebook) has
    the snapshot directory and the checked limits in its environment; a
    server it starts must not inherit them: it would show another engine's
    stale snapshot on /metrics, or take limits it was not given."""
    from vllm_output_rate import settings
    from vllm_output_rate.tools.common.client import Server

    monkeypatch.setenv(settings.name("TELEMETRY_DIR"), str(tmp_path))
    monkeypatch.setenv(settings.name("ACTIVE_CONFIG"), '{"pid": 1, "config": {}}')
    env = Server("m", [], tmp_path / "log").environment()
    assert settings.name("TELEMETRY_DIR") not in env and settings.name("ACTIVE_CONFIG") not in env
    given = Server("m", [], tmp_path / "log",
                   extra_env=settings.child_env(TELEMETRY_DIR=tmp_path / "mine")).environment()
    assert given[settings.name("TELEMETRY_DIR")] == str(tmp_path / "mine")
