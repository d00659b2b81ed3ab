"""``python -m vllm_output_rate.tools.fairness``: the ``fairness`` command."""

import sys

from vllm_output_rate.tools.fairness.cli import main

sys.exit(main())
