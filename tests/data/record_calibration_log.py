"""How ``calibration-events.jsonl`` and ``calibration-prompts.jsonl`` were
recorded (once; the test reads the files, it starts no engine): a real CPU
engine on the tiny generated model, serving with a default limit far above
what it can do (the event log needs the plugin's scheduler), driven by
``vllm-output-rate twin calibrate --url`` for about a minute; then the log
trimmed to its tokens, start and finished lines.

    python tests/data/record_calibration_log.py OUT_DIR

(``OUT_DIR/events-raw.jsonl`` is the whole log; the windows kept are
``trim``'s.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm_output_rate.tools.common.client import Server
from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model
from vllm_output_rate.tools.twin.calibrate import main as calibrate

SERVER_ARGS = ["--default-user-output-tokens-per-second", "100000", "--max-num-seqs", "16",
               "--max-model-len", "1024"]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "events-raw.jsonl"
    with Server(str(ensure_tiny_model()), SERVER_ARGS, out / "server.log",
                extra_env={"OUTPUT_RATE_EVENTS": str(raw)}) as server:
        calibrate(["--url", server.base_url, "--model", "tiny", "--events", str(raw),
                   "--duration", "60", "--prompts", str(out / "prompts-raw.jsonl"),
                   "--out", str(out / "step_time.json")])
    trim(raw, out / "prompts-raw.jsonl", out)


def trim(raw: Path, prompts: Path, out: Path, steps: int = 300) -> None:
    """The committed files: from each measured phase (concurrency level) a
    window of ``steps`` consecutive steps from its middle, each opened by a
    copy of the start line (the fitter takes no step period across one),
    with the finished lines of their requests (the fitter counts a
    request's earlier tokens from them); request ids shortened (``r<N>``)
    in both files."""
    lines = [json.loads(x) for x in raw.read_text().splitlines() if x.strip()]
    start = next(x for x in lines if x["kind"] == "start")
    steps_all = [x for x in lines if x["kind"] == "tokens"]
    finished = {x["request_id"]: x for x in lines if x["kind"] == "finished"}
    client = [json.loads(x) for x in prompts.read_text().splitlines() if x.strip()]
    phase_of, short = {}, {}
    for i, rec in enumerate(client):
        for rid in finished:
            if rec["request_id"] in rid:
                phase_of[rid], short[rid] = rec["phase"], (f"r{i}", rec)
    kept: list[dict] = [start]
    used: set[str] = set()
    for phase in dict.fromkeys(rec["phase"] for rec in client):
        if phase == "warmup":
            continue
        idx = [i for i, s in enumerate(steps_all)
               if all(phase_of.get(r) == phase for r, _, _ in s["tokens"])]
        if not idx:
            continue
        mid = idx[len(idx) // 2]
        window = steps_all[max(0, mid - steps // 2):mid + steps // 2]
        kept.append({**start, "t_ns": window[0]["t_ns"] - 1})
        for s in window:
            kept.append({**s, "tokens": [[short[r][0], u, n] for r, u, n in s["tokens"]]})
            used.update(r for r, _, _ in s["tokens"])
    for rid in sorted(used, key=lambda r: finished[r]["t_ns"]):
        kept.append({**finished[rid], "request_id": short[rid][0]})
    kept.sort(key=lambda x: x["t_ns"])
    with open(out / "calibration-events.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in kept)
    with open(out / "calibration-prompts.jsonl", "w") as f:
        for rid in sorted(used, key=lambda r: int(short[r][0][1:])):
            f.write(json.dumps({"request_id": short[rid][0],
                                "prompt_tokens": short[rid][1]["prompt_tokens"]}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trim"]:  # RAW PROMPTS OUT: trim a recorded log again
        trim(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        main(Path(sys.argv[1]))
