"""``python -m vllm_output_rate.tools.twin``: the ``twin`` command."""

import sys

from vllm_output_rate.tools.twin.cli import main

sys.exit(main(sys.argv[1:]))
