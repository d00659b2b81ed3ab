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

from vllm_patch import loadgen
from vllm_patch.loadgen import (
    ScenarioError,
    load_scenario,
    parse_scenario,
    request_body,
    run_scenario,
)

MINIMAL = {
    "name": "t",
    "users": {"a": 20, "c": "unlimited"},
    "prompts": {"short": "hi", "long": {"words": 50, "seed": 3},
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
    assert any(len(s.prompts[st.prompt].text.split()) >= 400 for st in streams)  # long prompts
    assert any(st.max_tokens <= 10 for st in streams)  # short answers
    assert any(not st.ignore_eos for st in streams)  # EOS
    assert any(st.cancel_after_tokens for st in streams) and any(st.cancel_after_s for st in streams)
    assert s.checks.baseline_phase == "baseline" and s.checks.compare_phase == "mixed"
    baseline = s.phases[0].streams
    assert {st.user for st in baseline} == {"user-c"}  # the unlimited user alone
    args = s.server_args()
    overrides = json.loads(args[args.index("--user-output-tokens-per-second") + 1])
    assert overrides == {"user-a": 20, "user-b": 60, "user-c": 100000}


def test_yaml_and_json_give_the_same_scenario(tmp_path):
    a = load_scenario(write(tmp_path, MINIMAL, "s.yaml"))
    b = load_scenario(write(tmp_path, MINIMAL, "s.json"))
    assert a.users == b.users and a.phases == b.phases and a.prompts == b.prompts
    assert a.users == {"a": Fraction(20), "c": None}
    assert a.prompts["shared"].text.startswith(a.prompts["long"].text)
    assert a.prompts["shared"].unique and a.prompts["shared"].prefix == "long"
    assert len(a.prompts["long"].text.split()) == 50
    assert a.expected_tokens() == 2 * 10 + 3


def test_generated_prompts_are_deterministic():
    assert loadgen.generated_text(30, 1) == loadgen.generated_text(30, 1)
    assert loadgen.generated_text(30, 1) != loadgen.generated_text(30, 2)


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
    (lambda d: d["prompts"].update(x={"text": "a", "words": 3}), ["prompts.x", "either text or words"]),
    (lambda d: d["prompts"].update(x=""), ["prompts.x", "must not be empty"]),
    (lambda d: d.update(server={"args": ["--user-output-tokens-per-second", "{}"]}),
     ["server.args", "limits come from users"]),
    (lambda d: d.update(server={"default_limit": 0}), ["server.default_limit", "0"]),
    (lambda d: d.update(checks={"baseline_phase": "zzz", "compare_phase": "one"}),
     ["checks.baseline_phase", "'zzz'"]),
    (lambda d: d.update(checks={"baseline_phase": "one"}), ["checks", "go together"]),
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


def fake_server(tokens_per_chunk=1, delay_s=0.0, finish_at=None, log=None):
    """An OpenAI-like streaming endpoint: one chunk per token with continuous usage."""

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

    return httpx.MockTransport(handler)


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
    # the shared-prefix prompt is made unique per request after its prefix
    text = bodies["orl-r1-0002"]["messages"][0]["content"]
    assert text.startswith(s.prompts["long"].text) and text.endswith("[request 2]")
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
    transport = httpx.MockTransport(lambda req: httpx.Response(400, text="beam search refused"))
    run = asyncio.run(run_scenario("http://fake", s, transport=transport))
    assert all(r.error and r.error.startswith("HTTP 400") for r in run.requests)
