"""``vllm-output-rate fairness``: the fairness benchmark's command (what
it runs: the package's docstring, ``tools.fairness``)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from vllm_output_rate.tools import fairness
from vllm_output_rate.tools.common.help_text import PlainHelpFormatter, description_and_epilog
from vllm_output_rate.tools.fairness import engine as fe
from vllm_output_rate.tools.fairness.arms import (ARMS, MORE_ARMS, arms_of, engine_runner,
                                                  run_scenario)
from vllm_output_rate.tools.fairness.figures import goals
from vllm_output_rate.tools.fairness.report import render
from vllm_output_rate.tools.fairness.scenarios import (ENGINE_SCALE, LONG_PROMPT_ARMS, SCALES,
                                                       SCENARIOS)


def main(argv: list[str] | None = None) -> int:
    description, epilog = description_and_epilog(fairness.__doc__)
    parser = argparse.ArgumentParser(prog="vllm-output-rate fairness", description=description,
                                     formatter_class=PlainHelpFormatter, epilog=epilog)
    parser.add_argument("--scale", choices=list(SCALES), default="small")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="repeat for several (default: all)")
    parser.add_argument("--arm", action="append", choices=[*ARMS, *MORE_ARMS],
                        help="repeat for several (default: each scenario's own: "
                        f"{', '.join(ARMS)}; long_prompts: its own, "
                        f"{', '.join(LONG_PROMPT_ARMS)})")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("twin", "cpu"), default="twin",
                        help="twin: vLLM's scheduler in virtual time (the default); cpu: a real "
                        "vLLM CPU engine per arm through the OpenAI API, the gateway arm the "
                        "real LiteLLM proxy (tools.fairness.engine; --scale is its own)")
    parser.add_argument("--model", help="--engine cpu: the model directory (default: the "
                        "tiny model, generated locally)")
    parser.add_argument("--litellm", help="--engine cpu: the litellm command of an environment "
                        "with litellm[proxy] (default: litellm on PATH; without one the gateway "
                        "arm is refused)")
    args = parser.parse_args(argv)
    scale = SCALES[args.scale]
    if args.engine == "cpu":
        scale = ENGINE_SCALE
    arms = args.arm or list(ARMS)
    names = args.scenario or list(SCENARIOS)
    for name in names:
        if not arms_of(SCENARIOS[name](scale, random.Random(args.seed)), args.arm):
            parser.error(f"--scenario {name} has none of the arms asked for")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "vllm-output-rate fairness " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != args.out and a != "--out")
    results: dict[str, Any] = {"scale": scale.__dict__ | {"capacity_tok_s": scale.capacity},
                               "engine": args.engine, "seed": args.seed, "arms": arms,
                               "scenarios": {}}
    progress = lambda m: print(m, file=sys.stderr)  # noqa: E731
    for name in names:
        runner = None
        if args.engine == "cpu":
            from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

            litellm = fe.find_litellm(args.litellm)
            gateways = [a for a in arms_of(SCENARIOS[name](scale, random.Random(args.seed)),
                                           args.arm) if a in fe.GATEWAYS]
            if gateways and litellm is None:
                parser.error(f"--arm {gateways[0]} on --engine cpu needs --litellm (no litellm "
                             "on PATH; --arm to leave it out)")
            runner = engine_runner(args.model or str(ensure_tiny_model()), litellm)
        results["scenarios"][name] = run_scenario(name, scale, args.arm, out, args.seed,
                                                  progress=progress, runner=runner)
    results["goals"] = goals(results["scenarios"], engine=args.engine == "cpu")
    (out / "fairness.json").write_text(json.dumps(results, indent=1) + "\n")
    text = render(results, scale, command.strip())
    (out / "fairness.md").write_text(text)
    print(text)
    return 0
