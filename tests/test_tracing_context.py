"""Spans in the caller's trace and their identity, with the real
OpenTelemetry SDK and an in-memory exporter: children of a request's
traceparent, a parent not sampled followed unless the sampler says
otherwise, the GenAI attributes, user.id only when trusted (hashed or left
out with the user label mode), vLLM's client-facing request id."""

from __future__ import annotations

import pytest

from harness import make_request
from tracing_setup import exporter, telemetry_mode  # noqa: F401  (fixtures)
from tracing_setup import PARENT_ID, TRACE_ID, limits, setup, spans, traceparent
from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.tracing.recorder import SpanRecorder


def by_request(span_list):
    out = {}
    for s in span_list:
        out.setdefault(s.attributes["output_rate.request_id"], []).append(s)
    return out


@pytest.mark.usefixtures("telemetry_mode")
def test_spans_of_a_request_with_a_traceparent_are_children_of_its_trace(tmp_path, exporter,
                                                                         monkeypatch):
    """A request with a valid traceparent: its throttle episodes and its
    generation span are children of that span (same trace id, the header's
    span as parent, its tracestate carried), not links; a request without
    one, or with a broken one, keeps spans of their own. The header is
    parsed by the span builder, not on the scheduler's thread."""
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10), background=False)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    child, plain, broken = (make_request("a", max_tokens=8) for _ in range(3))
    child.trace_headers = {"traceparent": traceparent(), "tracestate": "vendor=x"}
    broken.trace_headers = {"traceparent": "00-not-a-trace-01"}
    drv.add(child, plain, broken)
    drv.run_until_done()
    contexts = rec.generation.emitter._contexts
    assert not exporter.get_finished_spans() and not contexts  # nothing parsed yet
    throttles = by_request(spans(exporter, "output_rate.throttle"))
    gens = by_request(spans(exporter, "output_rate.generation"))
    for req in (child, plain, broken):
        assert throttles[req.request_id] and len(gens[req.request_id]) == 1
    for s in throttles[child.request_id] + gens[child.request_id]:
        assert format(s.context.trace_id, "032x") == TRACE_ID
        assert s.parent is not None and s.parent.is_remote
        assert format(s.parent.span_id, "016x") == PARENT_ID
        assert s.context.trace_state.get("vendor") == "x"
        assert not s.links
    others = throttles[plain.request_id] + gens[plain.request_id] + throttles[
        broken.request_id] + gens[broken.request_id]
    assert all(s.parent is None and not s.links for s in others)
    assert all(format(s.context.trace_id, "032x") != TRACE_ID for s in others)
    assert len({s.context.trace_id for s in others}) == len(others)  # each its own trace
    assert len(contexts) == 2  # parsed once per distinct header


@pytest.mark.parametrize("sampler", [None, "always_on"])
@pytest.mark.usefixtures("telemetry_mode")
def test_a_parent_that_is_not_sampled_is_followed_unless_the_sampler_says_otherwise(
        tmp_path, exporter, monkeypatch, sampler):
    """traceparent flags 00 (the caller did not sample): with the SDK's
    default parent-based sampler the request's spans are not recorded (the
    other requests' are); OTEL_TRACES_SAMPLER=always_on keeps them, still
    in the caller's trace."""
    if sampler is None:
        monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    quiet, other = make_request("a", max_tokens=6), make_request("a", max_tokens=6)
    quiet.trace_headers = {"traceparent": traceparent(flags="00")}
    drv.add(quiet, other)
    drv.run_until_done()
    gens = by_request(spans(exporter, "output_rate.generation"))
    throttles = by_request(spans(exporter, "output_rate.throttle"))
    assert gens[other.request_id] and throttles[other.request_id]
    if sampler is None:
        assert quiet.request_id not in gens and quiet.request_id not in throttles
    else:
        (gen,) = gens[quiet.request_id]
        assert format(gen.context.trace_id, "032x") == TRACE_ID
        assert format(gen.parent.span_id, "016x") == PARENT_ID


@pytest.mark.parametrize("source", [None, "header", "api_key"])
@pytest.mark.usefixtures("telemetry_mode")
def test_spans_carry_the_genai_attributes_and_user_id_only_when_trusted(
        tmp_path, exporter, monkeypatch, source):
    """GenAI conventions with vLLM's names: gen_ai.request.id is the id the
    client and vLLM's llm_request span know (the engine's id without
    vLLM's random suffix), gen_ai.response.model, gen_ai.usage.output_tokens,
    gen_ai.response.finish_reasons; user.id only when the API server vouched
    for the user (header or API key), output_rate.user always."""
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.config import TRUSTED_FIELD

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", max_tokens=6, req_id=f"chatcmpl-{i}-0123abc{i}") for i in range(2)]
    if source is not None:
        for r in reqs:
            r.sampling_params.extra_args[TRUSTED_FIELD] = source
    drv.add(*reqs)
    drv.run_until_done()
    gens = by_request(spans(exporter, "output_rate.generation"))
    throttles = by_request(spans(exporter, "output_rate.throttle"))
    model = SchedulerView(sched).model_name
    assert model
    for i, r in enumerate(reqs):
        (gen,) = gens[r.request_id]
        a = gen.attributes
        assert a["gen_ai.request.id"] == f"chatcmpl-{i}"
        assert a["output_rate.request_id"] == r.request_id
        assert a["gen_ai.response.model"] == model
        assert a["gen_ai.usage.output_tokens"] == 6 == a["output_rate.tokens_charged"]
        assert a["gen_ai.response.finish_reasons"] == ("length",)
        assert "output_rate.tokens" not in a and "output_rate.finish_reason" not in a
        for s in [gen] + throttles[r.request_id]:
            a = s.attributes
            assert a["gen_ai.request.id"] == f"chatcmpl-{i}"
            assert a["output_rate.user"] == "a"
            if source is None:  # the body named the user: no identity
                assert "user.id" not in a and "output_rate.identity_source" not in a
            else:
                assert a["user.id"] == "a" and a["output_rate.identity_source"] == source
    names = {k for s in exporter.get_finished_spans() for k in s.attributes}
    assert all(k.startswith("output_rate.") or k in GENAI_NAMES for k in names), names


#: the only attribute names outside the project's namespace
GENAI_NAMES = {"gen_ai.request.id", "gen_ai.response.model", "gen_ai.usage.output_tokens",
               "gen_ai.response.finish_reasons", "user.id"}


@pytest.mark.usefixtures("telemetry_mode")
def test_a_shared_budget_keeps_the_callers_user_id(tmp_path, exporter):
    """In "shared" mode an unlisted user spends the one __unlisted__ budget
    (output_rate.user); user.id, when trusted, is still the caller."""
    from vllm_output_rate.config import TRUSTED_FIELD

    sched, drv, tel, rec = setup(tmp_path, exporter,
                                 {**limits(1000, a=10), "unlisted_users": "shared"})
    req = make_request("someone", max_tokens=3)
    req.sampling_params.extra_args[TRUSTED_FIELD] = "header"
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes["output_rate.user"] == "__unlisted__"
    assert gen.attributes["output_rate.identity_source"] == "header"
    assert gen.attributes["user.id"] == "someone"


def test_external_request_id_is_vllms_client_facing_id(monkeypatch):
    from vllm_output_rate.tracing.attributes import external_request_id

    assert external_request_id("chatcmpl-abc-0123abcd") == "chatcmpl-abc"
    assert external_request_id("cmpl-9f2e4c1a7b3d4e5f-deadbeef") == "cmpl-9f2e4c1a7b3d4e5f"
    assert external_request_id("my-id") == "my-id"  # no suffix of vLLM's: as it is
    assert external_request_id("chatcmpl-abc-0123abcd", randomized=False) == "chatcmpl-abc-0123abcd"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    rec = SpanRecorder(None, None, clock_offset_ns=0, background=False)
    assert rec.generation.emitter.randomized_ids is False


@pytest.mark.parametrize("mode", ["hashed", "off"])
def test_span_ids_follow_the_user_label_mode(tmp_path, exporter, monkeypatch, mode):
    """user.id (trusted only, as before) and output_rate.user are hashed
    like the label, or left out with ``off``."""
    import json

    from vllm_output_rate import user_label
    from vllm_output_rate.config import TRUSTED_FIELD

    salt = tmp_path / "salt"
    salt.write_bytes(b"0123456789abcdef-salt")
    for name, value in user_label.child_settings(mode, str(salt) if mode == "hashed" else None).items():
        monkeypatch.setenv(name, value)
    user_label.forget()
    try:
        sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
        req = make_request("alice", max_tokens=3)
        req.sampling_params.extra_args[TRUSTED_FIELD] = "api_key"
        drv.add(req)
        drv.run_until_done()
    finally:
        user_label.forget()
    (gen,) = spans(exporter, "output_rate.generation")
    if mode == "hashed":
        label = user_label.hashed("alice", b"0123456789abcdef-salt")
        assert gen.attributes["user.id"] == gen.attributes["output_rate.user"] == label
    else:
        assert "user.id" not in gen.attributes and "output_rate.user" not in gen.attributes
    assert "alice" not in json.dumps({k: str(v) for k, v in gen.attributes.items()})
