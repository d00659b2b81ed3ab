"""OpenTelemetry spans of the output-rate limiter, from the engine-core
process.

Built from the same plain data the metrics use (``StepReport`` per step,
``IdleWait`` per idle wait, the engine outputs per ``update_from_output``;
see ``vllm_output_rate.observers``), driven by the telemetry (``telemetry.folds``), whose
worker thread (off the scheduler's thread) hands them to the span recorder.
The modules, in the order the data passes through them:

- ``recorder``: ``SpanRecorder``, the observer callbacks; queues their plain
  data (bounded) and replays it, off the scheduler's thread, into the
  builders below.
- ``series``: each request's spacing series, kept per update.
- ``throttle``: throttle episodes per request and over-limit periods per
  user, and their spans.
- ``generation``: a request's generation span when it ends, from its series
  and its throttle episodes.
- ``steps``: step, idle-wait and limits-reload spans (one event each).
- ``emit``: where the builders' spans are made (tracer, clock offset, the
  request's trace parent); ``attributes``: attribute names, request ids and
  identity, spacings and their quantiles.
- ``provider``: the tracer provider from the ``OTEL_*`` variables;
  ``drops``: the counted, bounded processor and ``TraceDrops``;
  ``exporters``: OTLP, several at once, the OTLP/JSON file.

The SDK spans go to a ``BatchSpanProcessor``, whose queue and exporter
thread export them. A full queue drops entries and a failing exporter loses
spans, both counted (``TraceDrops``, exported as
``vllm_output_rate_telemetry_dropped_total``) and logged once, never
blocking. Building and exporting a span costs the process some tens of
microseconds of CPU (BENCHMARKS.md): a request gets a throttle span only
for its longest episode of ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S`` (default
1 s) or more, and the user one span per over-limit period; the standard
``OTEL_TRACES_SAMPLER`` thins all spans. A throttle episode runs from the
first step a request was skipped for lack of budget to its last dispatch
before a step that did not skip it: a request pacing at its limit (a
token, then skipped again) has one over its pacing, not one per token.

Spans:
- ``output_rate.over_limit``: one per over-limit period of a user, from the
  start of the first throttle episode of one of its requests (skipped for
  lack of budget) to the end of the last, once none was
  open for ``PERIOD_QUIET_S`` after that (or the engine went idle): user,
  limit, tokens charged and their rate, its requests' throttle episodes
  (count, total, p50 / p90 / p99 / max in whole microseconds), most
  throttled requests and KV blocks (sampled at exports). Kept from
  episode events (a few per episode, appends in C), never from every
  refused user in every step.
- ``output_rate.throttle``: at most one per request, for its longest
  throttle episode when that lasted ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S``
  (default 1 s; 0: every throttled request) or longer, made when the request
  ends: from the first step it was skipped for lack of budget to its last
  dispatch before a step that did not skip it (or its abort): user,
  request id, priority, tokens charged by then, KV blocks held while it
  waited (when the episode began), preempted meanwhile, outcome.
- ``output_rate.step``: only for steps in which a token was refunded or a
  user refused (not for every step): charged / refunded counts and one event
  per refund with its reason.
- ``output_rate.idle_wait``: every idle wait of the engine loop: planned
  timeout, ready time waited for, lateness, what woke it.
- ``output_rate.limits_reload``: new limits in force, at the step boundary
  where they took effect: the limits file's digest before and after, the
  default rate before and after, and the users added, removed and changed
  (counted, and the first 64 of each listed).
- ``output_rate.generation``: one per finished request: token count,
  engine-side spacing p50 / p90 / p99 / max, the spacing series itself,
  ``output_rate.spacing_series_us``: an integer array of whole microseconds,
  at most ``MAX_SERIES`` values (an attribute, not one event per token: span
  events are capped at 128; integers are not cut by
  ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, which cuts strings only), and its
  throttle episodes (every one: count, total and longest).

A request's throttle and generation spans belong to its own trace: when it
came with a valid W3C ``traceparent`` (carried to the engine by the API
server's middleware whenever these traces are on, ``OTEL_*`` variables
alone included; vLLM passes its own ``trace_headers`` only with
``--otlp-traces-endpoint``, and those win), they are children of that span,
beside vLLM's own ``llm_request`` span when vLLM traces too, and follow its sampling
decision (the SDK's default sampler is parent-based; ``OTEL_TRACES_SAMPLER``
changes that); without one they start a trace of their own.

Attributes follow the OpenTelemetry GenAI conventions where one exists, with
the names vLLM's own request span uses (``vllm.tracing.SpanAttributes``):
``gen_ai.request.id`` (the request id the client and vLLM's ``llm_request``
span know, i.e. the engine's id without the random suffix vLLM adds),
``gen_ai.response.model``, ``gen_ai.usage.output_tokens``,
``gen_ai.response.finish_reasons``, and ``user.id`` when the API server
vouched for the user (a gateway's header or an API key); everything else is
under ``output_rate.`` (``output_rate.request_id`` is the engine's own id, as
in the event log; ``output_rate.user`` whose budget the request spends, also
when the request body named it).
"""
