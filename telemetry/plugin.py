"""Telemetry's ``vllm.general_plugins`` entry point: registers the engine
telemetry as an observer of the output-rate scheduler.

vLLM loads general plugins in every process (API server, engine core,
workers), possibly more than once; ``register()`` only records two callables
with ``vllm_output_rate.observers`` and is idempotent:

- ``prepare`` runs in the process that turns the feature on (the API server,
  or the ``LLM`` process), before the engine core starts: it makes the
  snapshot directory (inherited by the engine core through the environment)
  and installs the collector that shows the snapshots on vLLM's ``/metrics``;
- ``attach`` runs in the engine core when the scheduler starts: the
  per-step aggregation and its exporter thread (and the spans, when traces
  are asked for).

``OUTPUT_RATE_TELEMETRY=0`` turns both off; the limits stay on.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from vllm_output_rate import observers, settings
from vllm_output_rate.telemetry import collector, introspect
from vllm_output_rate.telemetry.engine import attach

NAME = "telemetry"


def prepare(vllm_config: Any = None) -> None:
    """Snapshot directory and ``/metrics`` collector for this server."""
    if not settings.get("TELEMETRY"):
        return
    directory = settings.get("TELEMETRY_DIR")
    if not directory:
        directory = tempfile.mkdtemp(prefix="vllm-output-rate-telemetry-")
        os.environ.update(settings.child_env(TELEMETRY_DIR=directory))
        # Ours to remove when this process (the server's top process, which
        # outlives its engine core and API servers) exits.
        atexit.register(shutil.rmtree, directory, True)
    collector.install(directory)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    observers.register_observer(NAME, attach, prepare)
    introspect.register()
