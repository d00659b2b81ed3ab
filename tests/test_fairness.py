"""The fairness benchmark (``tools.fairness``): its quick variant (the small
scale's flood, alone and long-prompts scenarios, every arm of each, in the
what-if twin's virtual time: exact and deterministic), the gateway arms'
emulated semantics, and the indices it reports."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.tools.fairness import cli, figures, scenarios
from vllm_output_rate.tools.fairness.arms import ARMS, GatewayEmulation
from vllm_output_rate.tools.fairness.figures import jain, water_fill
from vllm_output_rate.tools.fairness.scenarios import NS


def test_jain_and_water_fill():
    assert jain([1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain([]) is None
    # 90 shared 1:2, the first capped at 20: it keeps 20, the second the rest
    assert water_fill(90, {"a": 20, "b": 100}, {"a": 1, "b": 2}) == pytest.approx({"a": 20, "b": 70})
    assert water_fill(30, {"a": 100, "b": 100}, {"a": 1, "b": 2}) == pytest.approx({"a": 10, "b": 20})


def test_the_gateway_reserves_at_admission_and_trues_up_when_a_request_ends():
    """LiteLLM's tpm_limit as emulated: a 60 s window opened by the first
    request, prompt + max_tokens reserved at admission, refused when the
    window would go over, the reservation replaced by what was used."""
    gw = GatewayEmulation({"u": 1000})
    assert gw.admit("r1", "u", 100, 400, 0)  # 500 reserved
    assert gw.admit("r2", "u", 100, 400, 1 * NS)  # 1000
    assert not gw.admit("r3", "u", 1, 1, 2 * NS)  # would be 1002: 429
    gw.finished("r2", 100, 50, 3 * NS)  # used 150 of 500: 650 counted
    assert gw.admit("r4", "u", 100, 200, 4 * NS)  # 950
    assert not gw.admit("r5", "u", 10, 50, 5 * NS)
    assert gw.admit("r6", "u", 100, 800, 60 * NS)  # a new window
    # a request that ends in a later window leaves that window alone
    gw.finished("r1", 100, 400, 61 * NS)
    assert gw.windows["u"][1] == 900
    gw.finished("r6", 100, 100, 62 * NS)
    assert gw.windows["u"][1] == 200 and list(gw.reserved) == ["r4"]


def test_the_input_gateway_counts_prompt_tokens_alone():
    """LiteLLM's token_rate_limit_type: input, as emulated: a request
    reserves its prompt tokens (its max_tokens not counted), which is
    also what it used."""
    gw = GatewayEmulation({"u": 10_000}, count="input")
    assert gw.admit("r1", "u", 3800, 20, 0) and gw.admit("r2", "u", 3800, 5000, NS)
    assert not gw.admit("r3", "u", 3800, 1, 2 * NS)  # 11,400 > 10,000: 429
    assert gw.admit("r4", "u", 2000, 1, 3 * NS)  # 9,600
    gw.finished("r1", 3800, 20, 4 * NS)
    assert gw.windows["u"][1] == 9600
    with pytest.raises(ValueError):
        GatewayEmulation({}, count="output")


def test_the_long_prompts_scenario_is_seeded_and_has_its_own_arms():
    """Issue 48's load at the small scale: four steady users (a request
    every 2 s, 200 tokens in, 150 out) and a flooder (3,800 in, 20 out,
    four a second from 2 s), the same lines for the same seed; its step
    25 ms plus 20 us a prefill token; its arms its own, the others' not."""
    from vllm_output_rate.tools.fairness.arms import arm_limits, arms_of

    scale = scenarios.SCALES["small"]
    sc = scenarios.long_prompts(scale, scenarios.random.Random(0))
    assert sc.lines == scenarios.long_prompts(scale, scenarios.random.Random(0)).lines
    assert sc.lines != scenarios.long_prompts(scale, scenarios.random.Random(1)).lines
    steady = [x for x in sc.lines if x["user"] != "flooder"]
    flood = [x for x in sc.lines if x["user"] == "flooder"]
    assert len({x["user"] for x in steady}) == 4 and len(steady) == 4 * 15
    assert {(x["prompt_tokens"], x["max_tokens"]) for x in steady} == {(200, 150)}
    assert {(x["prompt_tokens"], x["max_tokens"]) for x in flood} == {(3800, 20)}
    assert len(flood) == 4 * 28 and min(x["t"] for x in flood) >= 2.0
    assert sc.rates["flooder"] == 5 and sc.rates["steady-0"] == 100
    assert (sc.step_time.base_s, sc.step_time.per_prefill_token_s) == (0.025, 20e-6)
    assert arms_of(sc, None) == list(scenarios.LONG_PROMPT_ARMS)
    assert arms_of(scenarios.flood(scale, scenarios.random.Random(0)), None) == list(ARMS)
    assert arms_of(sc, ["borrowing", "capped"]) == ["capped"]
    assert arm_limits(sc, "capped-prompt") == (
        "default: {rate: 100, prompt_rate: 20000}\nusers:\n"
        "  flooder: {rate: 5, prompt_rate: 4000}\n")
    assert arm_limits(sc, "capped") == "default: 100\nusers:\n  flooder: 5\n"
    assert arm_limits(sc, "fcfs") is None
    # the twin's generator makes the same load: ``twin workload long_prompts``
    import argparse

    from vllm_output_rate.tools.twin import workload

    parser = argparse.ArgumentParser()
    workload.add_generator_args(parser)
    args = parser.parse_args(["long_prompts", "--out", "x", "--users", "4", "--rate", "0.5",
                              "--prompt-tokens", "200", "--max-tokens", "150",
                              "--duration", "30"])
    assert workload.generate("long_prompts", args) == sc.lines
    cpu = scenarios.long_prompts(scenarios.ENGINE_SCALE, scenarios.random.Random(0))
    assert {x["prompt_tokens"] for x in cpu.lines if x["user"] == "flooder"} == {900}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("fairness")
    assert cli.main(["--scale", "small", "--scenario", "flood", "--scenario", "alone",
                     "--scenario", "long_prompts", "--out", str(out)]) == 0
    return json.loads((out / "fairness.json").read_text()), (out / "fairness.md").read_text()


def test_the_quick_variant_writes_every_arm_and_its_report(quick):
    results, text = quick
    for name in ("flood", "alone"):
        assert list(results["scenarios"][name]["arms"]) == list(ARMS)
    assert list(results["scenarios"]["flood"]["baseline"]) == list(ARMS)
    for arm in ARMS:
        assert f"| {arm} | flooder |" in text and f"| {arm} | steady |" in text
    assert "### Goals" in text


def test_a_flood_beside_steady_users_under_each_arm(quick):
    """The flood's figures, exact in virtual time: upstream FCFS lets the
    flooder's streams push the steady users' first tokens back by seconds;
    the capped arm keeps their TTFT p99 within 1.2x of theirs without the
    flood, holds the flooder at its rate, and loses nothing of theirs; the
    gateway refuses the flooder's requests at admission."""
    flood = results_of(quick, "flood")
    arms, baseline = flood["arms"], flood["baseline"]
    steady = {arm: arms[arm]["groups"]["steady"] for arm in ARMS}
    alone = {arm: baseline[arm]["groups"]["steady"] for arm in ARMS}
    assert steady["fcfs"]["ttft_s"]["p99"] > 50 * alone["fcfs"]["ttft_s"]["p99"]
    assert steady["capped"]["ttft_s"]["p99"] <= 1.2 * alone["capped"]["ttft_s"]["p99"]
    flooder = arms["capped"]["groups"]["flooder"]
    assert flooder["held_while_backlogged_min"] == pytest.approx(1.0, abs=0.01)
    assert arms["gateway"]["groups"]["flooder"]["refused"] > 0
    assert all(g["refused"] == 0 for arm in ("fcfs", "priority", "capped", "borrowing")
               for g in arms[arm]["groups"].values())
    # borrowing gives the flooder most of the capacity the steady users
    # leave (584 of FCFS's 617 tok/s when measured), the capped arm does not
    assert arms["borrowing"]["throughput_tok_s"] >= 0.9 * arms["fcfs"]["throughput_tok_s"]
    # (capped: every user at most its rate, the GCRA's burst aside)
    capped = arms["capped"]
    assert capped["throughput_tok_s"] <= 1.01 * sum(
        g["users"] * g["limit_tok_s"] for g in capped["groups"].values())
    assert capped["throughput_tok_s"] < 0.5 * arms["fcfs"]["throughput_tok_s"]
    # borrowing: the steady users' TTFT p99 at most a step over capped's
    # beside the same flood (55.0 against 49.6 ms: capped's went from 66.1
    # ms when a user's fresh waiting stream took its turn, which borrowing
    # does not do yet: residency), and at most one step over theirs without it (a steady
    # user's request beyond its guaranteed rate, its resident streams taking
    # its budget, borrows its first token, and may wait a step behind a
    # request of the flooder admitted within the flooder's budget:
    # FAIRNESS.md, the 1.2x goal)
    assert steady["borrowing"]["ttft_s"]["p99"] <= steady["capped"]["ttft_s"]["p99"] + scenarios.STEP_S
    assert steady["borrowing"]["ttft_s"]["p99"] <= alone["borrowing"]["ttft_s"]["p99"] + scenarios.STEP_S
    assert arms["borrowing"]["groups"]["flooder"]["borrowed_tokens"] > 0


def test_long_prompts_beside_steady_users_under_each_arm(quick):
    """Issue 48's goals in the twin (its step model): upstream FCFS makes
    every step that carries a flooder's prompt a long step for the steady
    users (their spacing p99 3x and more their figure without the flood);
    the limiter capped without prompt budgets holds the flooder's output,
    not its prompts (the same); with prompt budgets (just in time, the
    default) their spacing p99 and TTFT p99 stay within 1.2x of their
    figures without the flood while the flooder still gets its output
    rate while backlogged; the long-prefill threshold spreads the damage
    over every step; the input-token gateway refuses prompts once its
    minute's count is spent."""
    lp = results_of(quick, "long_prompts")
    arms, baseline = lp["arms"], lp["baseline"]
    assert list(arms) == list(scenarios.LONG_PROMPT_ARMS) == list(baseline)

    def ratio(arm, key):
        now, was = arms[arm]["groups"]["steady"][key], baseline[arm]["groups"]["steady"][key]
        return now["p99"] / was["p99"] if isinstance(now, dict) else now / was

    assert ratio("fcfs", "itl_p99_s") > 3 and ratio("capped", "itl_p99_s") > 3
    assert ratio("capped-prompt", "itl_p99_s") <= 1.2
    assert ratio("capped-prompt", "ttft_s") <= 1.2
    assert arms["capped-prompt"]["groups"]["flooder"]["held_while_backlogged_min"] >= 0.95
    assert ratio("fcfs-threshold", "itl_p99_s") < ratio("fcfs", "itl_p99_s")
    assert arms["gateway-input"]["groups"]["flooder"]["refused"] > 0
    goal = {g["goal"]: g for g in quick[0]["goals"]}
    assert all(g["met"] for name, g in goal.items() if name.startswith("long_prompts"))


def test_one_user_alone_borrows_what_the_feature_off_would_give(quick):
    goal = {g["goal"]: g for g in quick[0]["goals"]}
    met = goal["alone: borrowing throughput / feature off"]
    assert met["met"] and met["value"] >= 0.95


def results_of(quick, name):
    return quick[0]["scenarios"][name]


# -- the real engine's arms (tools.fairness.engine): what runs without one ----------


def test_the_engine_arms_flags_and_the_gateways_limits():
    from vllm_output_rate.tools.fairness import engine as fe

    assert fe.serve_args("fcfs", 8, None) == ["--max-model-len", "1024", "--max-num-seqs", "8"]
    assert fe.serve_args("priority", 8, None)[-2:] == ["--scheduling-policy", "priority"]
    assert fe.serve_args("fcfs-threshold", 8, None, 128)[-2:] == [
        "--long-prefill-token-threshold", "128"]
    assert "--max-num-active-seqs" in fe.serve_args("capped-prompt", 8, fe.Path("l.yaml"))
    ours = fe.serve_args("borrowing", 8, fe.Path("l.yaml"))
    assert ours[ours.index("--max-num-seqs") + 1] == "32"
    assert ours[ours.index("--max-num-active-seqs") + 1] == "8"
    assert ours[-2:] == ["--output-rate-limits-file", "l.yaml"]
    # the gateway's keys: tokens a minute, the guaranteed rate x 60
    assert fe.gateway_limits({"a": 40.0, "b": 2.5}) == {"a": 2400, "b": 150}
    import yaml

    config = yaml.safe_load(fe.litellm_config(8123))
    (model,) = config["model_list"]
    assert model["litellm_params"]["api_base"] == "http://127.0.0.1:8123/v1"
    settings = config["general_settings"]
    assert settings["custom_auth"] == "custom_auth.user_api_key_auth"
    assert settings["token_rate_limit_type"] == "output"
    assert yaml.safe_load(fe.litellm_config(8123, "input"))["general_settings"][
        "token_rate_limit_type"] == "input"
    assert settings["master_key"].startswith("sk-") and settings["master_key"] != "sk-1234"
    compile(fe.CUSTOM_AUTH, "custom_auth.py", "exec")  # the hook the proxy imports


def test_the_engine_records_become_the_twins_figures():
    """Client records (chunk arrival times and token counts) give what
    ``figures.figures`` reads: tokens, refusals, TTFT and spacing samples,
    tokens in the busy window; borrowed tokens from the two scrapes."""
    from vllm_output_rate.tools.fairness import engine as fe

    w = figures.WARMUP_S
    recs = [fe.Record("a", 1.0, [(1.5, 1), (2.0, 2), (2.5, 4)], 4, ended=2.6),
            fe.Record("a", w + 1.0, [(w + 1.25, 1), (w + 1.5, 2), (40.0, 3)], 3),
            fe.Record("b", 3.0, refused=True)]
    scrapes = {"begin": {"a": 10.0}, "end": {"a": 25.0}}
    res = fe.result_of(recs, 40.0, scrapes, 30.0, w)
    users = res["summary"]["users"]
    assert users["a"]["output_tokens"] == 7 and users["a"]["borrowed_tokens"] == 25
    assert users["b"]["refused"] == 1 and users["b"]["output_tokens"] == 0
    ttft, itl = res["samples"]["a"]
    assert ttft == [int(0.5 * NS), int(0.25 * NS)]
    # the last chunk of the first request carried two tokens: two spacings
    assert itl[:3] == [int(0.5 * NS), int(0.25 * NS), int(0.25 * NS)]
    assert res["busy_tokens"] == {"a": 2}  # the second request's first two, in [5, 30)
    # spans from sending to the stream's end (None: cut first); refused: none
    assert res["spans"] == {"a": [(1.0, 2.6), (w + 1.0, None)]}
    assert res["tokens_by_s"] == {"a": {1: 1, 2: 3, w + 1: 2, 40: 1}}
    assert res["busy_borrowed"] == {"a": 15}
    text = ('vllm_output_rate_tokens_borrowed_total{user="a"} 3.0\n'
            'vllm_output_rate_tokens_borrowed_total{engine="0",user="b"} 2.0\n'
            'vllm_output_rate_tokens_charged_total{user="a"} 9.0\n')
    assert fe.borrowed_by_user(text) == {"a": 3.0, "b": 2.0}


def test_backlogged_seconds_are_whole_seconds_with_enough_requests_open():
    bs = figures.backlogged_seconds
    assert bs([(5.5, 9.0)], 1, 5, 12) == [6, 7, 8]  # [5, 6) and [9, 10) only partly
    assert bs([(5.0, 9.0)], 1, 5, 12) == [5, 6, 7, 8]  # open from 5.0 on: second 5 whole
    assert bs([(5.0, 7.0), (7.0, None)], 1, 5, 10) == [5, 6, 7, 8, 9]  # one ends as one starts
    assert bs([(5.0, 7.5), (7.6, None)], 1, 5, 10) == [5, 6, 8, 9]  # a gap in second 7
    assert bs([(5.0, None), (6.2, 8.0)], 2, 5, 10) == [7]  # two open: only second 7 whole
    assert bs([], 1, 5, 10) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.one_of(st.none(), st.integers(0, 400))),
                max_size=8), st.integers(1, 3))
def test_backlogged_seconds_against_sampling(raw, need):
    """Against the open count sampled every 0.1 s (spans on a 0.1 s grid)."""
    spans = [(a / 10, None if b is None else max(a, b) / 10) for a, b in raw]

    def open_at(t10: int) -> int:
        return sum(1 for a, b in spans if a * 10 <= t10 and (b is None or t10 < b * 10))

    want = [s for s in range(0, 40) if all(open_at(10 * s + k) >= need for k in range(10))]
    assert figures.backlogged_seconds(spans, need, 0, 40) == want


def test_a_user_whose_requests_come_late_is_read_over_the_seconds_it_asked():
    """The GPU tiers run's least user (0.86 of its rate over the whole busy
    window): two requests early, five in its last 3 s; between them it
    asked for nothing. Over its backlogged seconds it held its rate."""
    scenario = scenarios.Scenario("t", "", [], {"u": 10.0}, {"u": "g"})
    scale = scenarios.Scale("s", 4, 1, 30.0)
    spans = [(7.3, 12.5), (27.0, None)]
    by_s = {s: 10 for s in range(8, 12)} | {s: 12 for s in range(27, 30)}
    held = figures.held_while_backlogged(scenario, scale, {"spans": {"u": spans},
                                                            "tokens_by_s": {"u": by_s}})
    # seconds 8-11 and 27-29: 40 + 36 tokens over 7 s at 10 tok/s
    assert held == {"u": pytest.approx(76 / 70)}
    short = figures.held_while_backlogged(scenario, scale, {"spans": {"u": [(27.0, None)]},
                                                             "tokens_by_s": {"u": by_s}})
    assert short == {"u": pytest.approx(36 / 30)}  # 3 seconds: MIN_BACKLOGGED_S
    assert figures.held_while_backlogged(scenario, scale, {"spans": {"u": [(27.5, None)]},
                                                            "tokens_by_s": {"u": by_s}}) == {}


def test_the_rate_goal_with_nobody_backlogged_says_so():
    """On the real engine, borrowing served every request as it came (no
    user had enough requests open for a whole second): the guarantee never
    bound, and the goal's row says that rather than leaving the goal out."""
    def arm(held, ttft, itl):
        return {"groups": {"heavy": {"held_while_backlogged_min": held,
                                     "ttft_s": {"p50": ttft, "p99": ttft}, "itl_p99_s": itl}},
                "jain_borrowed": None}

    for held, value, met in ((None, None, True), (0.97, 0.97, False), (1.2, 1.2, True)):
        res = {"overload": {"arms": {"borrowing": arm(held, 1.0, 0.01),
                                     "capped": arm(1.0, 2.0, 0.1)}}}
        (goal,) = [g for g in figures.goals(res) if "while backlogged" in g["goal"]]
        assert (goal["value"], goal["met"]) == (value, met)


def test_engine_side_ttft_from_the_event_log(tmp_path):
    """Per user, from each request's ``queued`` line (the scheduler received
    it; without one, the client's send in monotonic ns) to the first step
    of the engine's event log that gave it a token, matched by the client's
    X-Request-Id inside vLLM's request id; refused requests and other
    requests of the log (a warm-up) left out."""
    from vllm_output_rate.tools.fairness import engine as fe

    events = tmp_path / "events.jsonl"
    lines = [{"kind": "tokens", "t_ns": 1_000, "tokens": [["cmpl-warmup-0", "a", 1]]},
             {"kind": "tokens", "t_ns": 5_000, "tokens": [["cmpl-fair-1-a-0", "a", 1]]},
             {"kind": "tokens", "t_ns": 7_000, "tokens": [["cmpl-fair-1-a-0", "a", 1],
                                                          ["cmpl-fair-10-a-0", "a", 2]]},
             {"kind": "tokens", "t_ns": 9_000, "tokens": [["cmpl-fair-2-b-0", "b", 1]]},
             # fair-2-b reached the scheduler 4,000 ns after it was sent
             {"kind": "queued", "t_ns": 6_000, "request_id": "cmpl-fair-2-b-0", "user": "b"}]
    events.write_text("".join(json.dumps(x) + "\n" for x in lines))
    recs = [fe.Record("a", 0.0, cid="fair-1-a", sent_ns=1_500),
            fe.Record("a", 0.0, cid="fair-10-a", sent_ns=6_000),
            fe.Record("b", 0.0, cid="fair-2-b", sent_ns=2_000),
            fe.Record("b", 0.0, cid="fair-3-b", sent_ns=2_000, refused=True)]
    assert fe.engine_ttft(events, recs) == {"a": [3_500, 1_000], "b": [3_000]}
    # spacing engine-side: fair-1-a's second token 2,000 ns after its first
    # (fair-10-a's two tokens in its first step: no spacing yet)
    assert fe.engine_spacing(events, recs) == {"a": [2_000]}
    # and the figures' groups carry it, as quantiles in seconds
    scenario = scenarios.Scenario("f", "", [], {"a": 1.0, "b": 1.0}, {"a": "g", "b": "g"})
    result = fe.result_of(recs[:3], 40.0, {}, 30.0, figures.WARMUP_S)
    result["engine_ttft"] = {"a": [350_000_000, 100_000_000], "b": [700_000_000]}
    lines_ = [{"user": u, "max_tokens": 1, "t": 0.0, "prompt_tokens": 1} for u in "ab"]
    (g,) = figures.figures(scenario, scenarios.ENGINE_SCALE, result, lines_)["groups"].values()
    assert g["ttft_engine_s"]["p99"] == pytest.approx(0.7, rel=0.02)
    assert g["ttft_engine_s"]["p50"] == pytest.approx(0.35)
