"""``python -m vllm_output_rate.tools.verify``: the ``verify`` command."""

import sys

from vllm_output_rate.tools.verify.cli import main

sys.exit(main(sys.argv[1:]))
