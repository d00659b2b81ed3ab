"""``python -m vllm_output_rate.tools.loadgen``: the ``loadgen`` command."""

import sys

from vllm_output_rate.tools.loadgen.run import main

sys.exit(main(sys.argv[1:]))
