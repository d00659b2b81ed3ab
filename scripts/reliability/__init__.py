"""Reliability runs against a real CPU engine: the fault and bad-input
matrix (``stress``: ``vllm-output-rate stress``, its groups of cases in
``config_cases``, ``request_cases``, ``client_faults``, ``identity_churn``,
``tenants`` and ``telemetry_faults``) and the long mixed load (``soak``:
``vllm-output-rate soak``); what their cases and reports are made of in
``cases``."""
