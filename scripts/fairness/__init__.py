"""The fairness benchmark: the same workloads under the arms an operator
would pick instead of, or with, this limiter, side by side in one run.

``vllm-output-rate fairness [--scale small|gpu] [--scenario NAME ...]
[--arm NAME ...] --out DIR [--seed N]``

Every arm of a scenario runs the same workload (same seed, same arrivals,
same sizes) through vLLM's own scheduler in the what-if twin
(``tools.twin``: the real ``Scheduler``, its KV cache manager, the plugin's
limiter, virtual time, a fixed step time):

* ``fcfs``: upstream vLLM, the feature off (first come, first served);
* ``priority``: upstream vLLM with ``--scheduling-policy priority``, each
  user's tier mapped to a request priority (the better tier first);
* ``gateway``: upstream vLLM behind a per-user token limit at admission,
  an **emulation** of LiteLLM's proxy with a ``tpm_limit`` per key
  (``GatewayEmulation``: its documented and coded semantics, not LiteLLM
  itself);
* ``capped``: this project, each user's guaranteed rate as a plain limit;
* ``borrowing``: this project, the same rates with ``ceiling: unlimited``
  (guaranteed rate plus what nobody within its rate uses).

The ``long_prompts`` scenario has arms of its own: ``fcfs``,
``fcfs-threshold`` (``--long-prefill-token-threshold``), ``priority``,
``gateway-input`` (the gateway counting prompt tokens alone: LiteLLM's
``token_rate_limit_type: input``, emulated), ``capped`` and
``capped-prompt`` (with prompt budgets, ``prompt_rate``).

Scenarios (``SCENARIOS``; fixed seeds): ``flood`` (one user opens many
streams beside steady users; also run without the flood, the victims'
baseline), ``overload`` (VTC's: two users, one sending twice the other's
load, together above capacity), ``tiers`` (gold and free, the gold rate
four times the free), ``bursts`` (on/off users beside steady ones),
``clients`` (many heterogeneous clients, ServeGen-like), ``alone`` (one user
with many streams and nobody else: what borrowing gives back),
``long_prompts`` (issue 48: steady users beside one sending long prompts
with short answers several times a second; its step 25 ms plus 20 us a
prompt token, also run without the long prompts).

Scales: ``small`` (16 sequences, a handful of users) and ``gpu`` (1,024
sequences, 1,000 users), both with a 25 ms step. Per user and arm: output
tok/s against the guaranteed rate, TTFT p50/p99, inter-token spacing p99,
requests refused; per arm: throughput and the weighted Jain's index over
backlogged users. Written to ``--out``: ``fairness.json`` (every figure)
and ``fairness.md`` (the tables and the goals checked).
"""
