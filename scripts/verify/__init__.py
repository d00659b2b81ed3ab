"""Engine-side ITL verification: run a scenario, then check the engine's own
per-token timestamps against the limits.

``vllm-output-rate verify [--server URL --events FILE | --model DIR]
[--scenario FILE] [--report DIR]``

With ``--model`` it starts ``vllm-output-rate serve`` on that model with the
scenario's limits and server flags, turns on the engine event log
(``OUTPUT_RATE_EVENTS``), runs the scenario, stops the server. With
``--server`` the server must already write its event log to ``--events``.
Then, from the engine-side events (``tokens`` per step, ``finished`` per
request, ``throttled`` about once a second, ``start``) and vLLM's
``/metrics``, it checks per user:

* ``gcra_bound``: in every window between two token events, tokens <=
  floor((W + burst) x limit) + 1 with the limiter's burst
  (``vllm_output_rate.limiter.BURST_NS``; see "Step slack" in the report);
* ``prompt_bound``: when the served limits carry a ``prompt_rate``, the
  prompt budget's bound the same way over the steps that computed the
  user's prompts (the engine log's ``prompt`` lines, stamped at dispatch):
  prompt tokens <= floor((W + burst) x prompt_rate) + 1, or + its largest
  prompt without chunked prefill;
* ``rate``: the achieved rate >= ``rate_min_ratio`` x limit while the user's
  demand exceeded it (while at least one of its requests was generating);
* ``spacing``: the per-stream spacing p50 within ``spacing_tolerance`` of
  streams / limit (streams counted at each moment);
* ``complete``: every non-cancelled response complete, ``completion_tokens``
  = the engine's token count = the engine's ``output_tokens``;
* ``freed``: cancelled requests finished in the engine, nothing throttled,
  running, waiting or holding KV after the run;
* ``resumed``: the user was throttled, every request came back and finished,
  no request stalled;
* ``charged``: the engine charged at least what it produced;
* ``unlimited``: an unlimited user's spacing p50 beside the limited load at
  most ``unlimited_max_ratio`` x its p50 alone;
* ``limits``, ``events``, ``prefix_cache``: the run tested what it claims.

Writes ``report.md`` and PNG plots into the report directory; exit 0 only
when every check holds, 1 when one fails, 2 when the run could not be made.

Modules: ``gcra`` (the limiter's bound over every window), ``analysis``
(the client's records matched to the engine's events, per-user figures),
``checks``, ``plots``, ``report`` (``report.md``) and ``cli`` (the run and
the command).
"""
