"""Generation spans with the real OpenTelemetry SDK and an in-memory
exporter: the spacing series (an integer array, whole past the attribute
length limit, capped while the token count is not, bounded while a request
runs, equal to the delivered spacings), and a client abort mid-throttle
ending the episode and the generation."""

from __future__ import annotations

import pytest

from harness import make_request
from tracing_setup import exporter, telemetry_mode  # noqa: F401  (fixtures)
from tracing_setup import TOKENS, cap_series, limits, series, setup, spans


@pytest.mark.usefixtures("telemetry_mode")
def test_generation_span_carries_the_spacing_series(tmp_path, exporter, monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(20))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    req = make_request("a", max_tokens=12)
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    times = [t for _, t in drv.tokens[req.request_id]]
    assert series(gen) == [(b - a) // 1000 for a, b in zip(times, times[1:])]
    assert gen.attributes[TOKENS] == 12
    assert gen.attributes["output_rate.spacing_p50_us"] == pytest.approx(50_000, abs=10_000)


@pytest.mark.usefixtures("telemetry_mode")
def test_the_spacing_series_survives_the_attribute_value_length_limit(tmp_path, exporter,
                                                                      monkeypatch):
    """OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT (read by the TracerProvider's
    SpanLimits) cuts string values, here to 16 characters: the series is an
    integer array and stays whole."""
    import vllm_output_rate.telemetry.engine as engine_mod

    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "16")
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(20))
    assert rec.generation.emitter.tracer._span_limits.max_attribute_length == 16
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    user = "a-user-with-a-rather-long-id"
    req = make_request(user, max_tokens=40)
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes["output_rate.user"] == user[:16]  # the limit is in force
    times = [t for _, t in drv.tokens[req.request_id]]
    assert series(gen) == [(b - a) // 1000 for a, b in zip(times, times[1:])]
    assert len(series(gen)) == 39 and gen.attributes["output_rate.spacing_series_truncated"] is False


@pytest.mark.usefixtures("telemetry_mode")
def test_client_abort_mid_throttle_ends_the_episode_and_the_generation(tmp_path, exporter,
                                                                      monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm.v1.request import RequestStatus

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=5))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", max_tokens=50) for _ in range(2)]
    drv.add(*reqs)
    drv.run(20)
    assert not spans(exporter, "output_rate.generation")
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    gens = spans(exporter, "output_rate.generation")
    assert sorted(s.attributes["output_rate.request_id"] for s in gens) == sorted(
        r.request_id for r in reqs)
    assert all(s.attributes["gen_ai.response.finish_reasons"] == ("abort",) for s in gens)
    assert all(0 < s.attributes[TOKENS] < 50 for s in gens)
    # one throttle span each: the two streams took turns at the limit, one
    # episode each over their pacing, ended by the abort, with the KV blocks
    # they held while they waited
    throttles = spans(exporter, "output_rate.throttle")
    assert sorted(s.attributes["output_rate.request_id"] for s in throttles) == sorted(
        r.request_id for r in reqs)
    assert {s.attributes["output_rate.outcome"] for s in throttles} == {"aborted"}
    assert all(s.attributes["output_rate.held_kv"] and s.attributes["output_rate.kv_blocks"] > 0
               for s in throttles)
    assert all(g.attributes["output_rate.throttle_episodes"] == 1 for g in gens)
    assert not tel._open_held and not tel._episodes
    assert not rec.throttle._throttle_ns and not rec.throttle._throttle_books
    assert not rec.generation.series._series and not rec.generation.series._overflow


@pytest.mark.usefixtures("telemetry_mode")
def test_generation_series_is_capped_and_the_token_count_is_not(tmp_path, exporter, monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod

    cap_series(monkeypatch, series_mod, throttle_mod, 16)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.add(make_request("a", max_tokens=40))
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes[TOKENS] == 40
    assert gen.attributes["output_rate.spacing_series_truncated"] is True
    assert len(series(gen)) == 16
    assert not rec.generation.series._overflow


@pytest.mark.usefixtures("telemetry_mode")
def test_a_long_generation_series_stays_bounded_while_it_runs(tmp_path, exporter, monkeypatch):
    """Steady tokens are not appended per request: the timeline of update
    spacings and the open runs hold them, and every TRIM_EVERY updates the
    series past the cap are cut and the timeline is cut to the oldest open
    run; both stay bounded while the request runs, and the count is exact."""
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod

    cap_series(monkeypatch, series_mod, throttle_mod, 16)
    monkeypatch.setattr(series_mod, "TRIM_EVERY", 8)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000))
    book = rec.generation.series
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    req = make_request("a", max_tokens=120)
    drv.add(req)
    longest = timeline = 0
    for _ in range(119):
        drv.step()
        tel.drain()  # (deferred: the telemetry's worker folds the step)
        rec.flush()  # (the builder keeps the series)
        longest = max(longest, len(book._series.get(req.request_id, ())))
        timeline = max(timeline, len(book._gaps))
        if req.request_id in book._series:  # every token so far, kept or not
            assert book.spacings(req.request_id) == drv.count(req.request_id) - 1
    assert longest == 16  # cut back to the cap while running
    assert 16 < timeline <= 16 + 2 * 8  # the timeline was cut too
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes[TOKENS] == 120
    assert len(series(gen)) == 16
    assert not book._overflow and not book._series and not book._runs
    # a request that is never steady (its tokens come one by one after pauses)
    for i in range(100):
        book.on_tokens("paused", 1, None if i == 0 else i * 1000, i * 1000 + 500)
        book.on_zeros("paused", 2)
        assert len(book._series["paused"]) <= 16 + 8 + 2
    rec.on_aborted([("paused", "a")], 200_000)
    gen = [s for s in spans(exporter, "output_rate.generation")
           if s.attributes["output_rate.request_id"] == "paused"]
    assert gen[0].attributes[TOKENS] == 300


@pytest.mark.parametrize("cap", [10_000, 5])
@pytest.mark.usefixtures("telemetry_mode")
def test_generation_series_equal_the_delivered_spacings(tmp_path, exporter, monkeypatch, cap):
    """Steady runs, pauses at the limit, resumptions, two tokens in one
    update, aborts, and the timeline cut every 3 updates while runs are
    open: every generation span's series is the spacings of the tokens its
    request delivered (the first ``cap`` of them), its count exact."""
    import itertools
    from collections import deque

    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tools.common import scheduler_driver

    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod
    from vllm.v1.request import RequestStatus

    cap_series(monkeypatch, series_mod, throttle_mod, cap)
    monkeypatch.setattr(series_mod, "TRIM_EVERY", 3)
    plain = scheduler_driver.model_output_for

    calls = itertools.count()

    def sometimes_two(scheduler, out, token=scheduler_driver.SAMPLED_TOKEN):
        mro = plain(scheduler, out, token)
        n = next(calls)
        for i, _req_id in enumerate(mro.req_ids):  # a second token now and then
            if mro.sampled_token_ids[i] and (n + i) % 7 == 0:
                mro.sampled_token_ids[i] = [token, token]
        return mro

    monkeypatch.setattr(scheduler_driver, "model_output_for", sometimes_two)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=30, b=70))
    book = rec.generation.series
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    users = ["a", "a", "a", "b", "b", "c", "c", "d"]
    reqs = [make_request(u, max_tokens=20 + 7 * i) for i, u in enumerate(users)]
    drv.add(*reqs)
    recent = deque(maxlen=4)
    for step in range(2000):
        if not sched.has_requests():
            break
        rec.flush()  # (its builder thread may be mid-replay: build here, then read)
        open_runs = list(book._runs.values())
        drv.step()
        if step == 30:
            sched.finish_requests([reqs[1].request_id, reqs[5].request_id],
                                  RequestStatus.FINISHED_ABORTED)
        rec.flush()
        # the timeline holds no more than the runs open in the last 3
        # updates (it is cut every 3) need
        recent.append(min(open_runs + list(book._runs.values()), default=book._index))
        assert len(book._gaps) <= book._index - min(recent) + 1
    gens = {s.attributes["output_rate.request_id"]: s for s in spans(exporter, "output_rate.generation")}
    assert set(gens) == {r.request_id for r in reqs}
    twos = 0
    for r in reqs:
        times = [t for _, t in drv.tokens[r.request_id]]
        want = [(b - a) // 1000 for a, b in zip(times, times[1:])]
        twos += want.count(0)
        attrs = gens[r.request_id].attributes
        assert series(gens[r.request_id]) == want[:cap]
        assert attrs[TOKENS] == len(times)
        assert attrs["output_rate.spacing_series_truncated"] == (len(want) >= cap)
    assert twos > 3  # the two-token updates did happen
    assert not book._series and not book._runs and not book._overflow and not rec.generation._who
