"""The engine event log's format: what the engine core's encoder writes, byte
for byte, and what the verifier's reader makes of it."""

from __future__ import annotations

from vllm_output_rate.telemetry.events import EngineLog, encode_event

#: one record of each kind as the engine queues it, and its line in the log
RECORDS = [
    (("start", 5, 1_700_000_000_000_000_000, {"a": 20.0}, 1000.0, True),
     '{"kind": "start", "t_ns": 5, "unix_ns": 1700000000000000000, "engine": "0", '
     '"limits": {"a": 20.0}, "default_limit": 1000.0, "async_scheduling": true}\n'),
    (("tokens", 10, [("chatcmpl-r1-0123abcd", "a", 1), ("chatcmpl-r2-0123abcd", "b", 2)]),
     '{"kind": "tokens", "t_ns": 10, "tokens": [["chatcmpl-r1-0123abcd", "a", 1], '
     '["chatcmpl-r2-0123abcd", "b", 2]]}\n'),
    (("queued", 8, "chatcmpl-r1-0123abcd", "a"),
     '{"kind": "queued", "t_ns": 8, "request_id": "chatcmpl-r1-0123abcd", "user": "a"}\n'),
    (("throttled", 20, {"a": 2}, {"a": 6}, 0.25),
     '{"kind": "throttled", "t_ns": 20, "requests": {"a": 2}, "kv_blocks": {"a": 6}, '
     '"kv_share": 0.25}\n'),
    (("finished", 30, "chatcmpl-r1-0123abcd", "a", "abort", 4),
     '{"kind": "finished", "t_ns": 30, "request_id": "chatcmpl-r1-0123abcd", "user": "a", '
     '"reason": "abort", "output_tokens": 4}\n'),
]


def test_the_encoder_writes_the_documented_lines():
    for record, line in RECORDS:
        assert encode_event(record, "0") == line


def test_the_reader_reads_what_the_encoder_writes(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("".join(encode_event(record, "0") for record, _ in RECORDS))
    log = EngineLog.read(path)
    assert log.bad_lines == []
    assert [s["limits"] for s in log.starts] == [{"a": 20.0}]
    assert log.starts[0]["engine"] == "0" and log.starts[0]["default_limit"] == 1000.0
    assert log.starts[0]["async_scheduling"] is True
    assert log.steps == [(10, [("chatcmpl-r1-0123abcd", "a", 1), ("chatcmpl-r2-0123abcd", "b", 2)])]
    assert log.throttled == [{"kind": "throttled", "t_ns": 20, "requests": {"a": 2},
                              "kv_blocks": {"a": 6}, "kv_share": 0.25}]
    assert log.finished["chatcmpl-r1-0123abcd"]["output_tokens"] == 4
    assert log.queued == {"chatcmpl-r1-0123abcd": (8, "a")}
    # queued at 8, its first token in the step stamped 10
    assert log.engine_ttfts_ns("a") == {"chatcmpl-r1-0123abcd": 2}
    assert log.engine_ttfts_ns("b") == {} and log.engine_ttfts_ns("a", since_ns=9) == {}
    assert log.finished["chatcmpl-r1-0123abcd"]["reason"] == "abort"


def test_the_verifier_reads_with_the_same_reader():
    from vllm_output_rate.tools.verify import analysis, cli

    assert analysis.EngineLog is EngineLog and cli.EngineLog is EngineLog


def test_every_users_spends_in_one_pass_match_one_user_at_a_time():
    import json as _json

    from vllm_output_rate.telemetry.events import EngineLog as _Log

    lines = [_json.dumps({"kind": "tokens", "t_ns": 10 * i,
                          "tokens": [[f"r{i}", f"u{i % 3}", 1], [f"s{i}", f"u{i % 2}", 2]]})
             for i in range(1, 40)]
    log = _Log.from_lines(lines)
    every = log.all_user_spends(100)
    assert set(every) == {"u0", "u1", "u2"}
    for user, spends in every.items():
        assert spends == log.user_spends(user, 100)
    # one step of slack: each spend's step may have been dispatched at the previous output
    assert every["u0"][:2] == [(100, 2), (120, 3)]  # t=120: one token and two
    assert log.dispatch_lower_bounds([t for t, _ in every["u0"]])[:2] == [90, 110]
