"""What the telemetry modules (``test_telemetry_*.py``) share: the real
scheduler on a virtual clock with the engine telemetry attached (no worker
thread: the tests export and fold), its counters, and the engine event log
stamped on the fake clock."""

from __future__ import annotations

import json

from harness import Driver, VirtualClock, attach_telemetry, make_scheduler


def limits(default, **users):
    return {"default_user_output_tokens_per_second": default,
            "user_output_tokens_per_second": users}


def setup(tmp_path, lim, top_k=100, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    tel = attach_telemetry(sched, str(tmp_path), top_k=top_k, start_thread=False)
    return sched, Driver(sched, clock, step_ms=10.0), tel


def counter(tel, name, *labels):
    return tel.counters.get((name, tuple(labels)), 0)


def events_setup(tmp_path, lim, monkeypatch, **kw):
    import vllm_output_rate.telemetry.engine as engine_mod

    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", clock)
    path = tmp_path / "events.jsonl"
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, events_path=str(path))
    return sched, Driver(sched, clock, step_ms=10.0), tel, path


def read_events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]
