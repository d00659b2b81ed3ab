"""Plugin wiring: version check, CLI options, refused configurations."""

from __future__ import annotations

import json

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness import make_vllm_config, tiny_model
from vllm_patch import plugin
from vllm_patch.config import DEFAULT_OPTION, USERS_OPTION, OutputRateConfigError
from vllm_patch.internals import UnsupportedVllmVersion, check_vllm_version


def test_register_is_idempotent():
    plugin.register()
    plugin.register()
    parser = make_arg_parser(FlexibleArgumentParser())
    flags = [opt for action in parser._actions for opt in action.option_strings]
    assert flags.count(DEFAULT_OPTION) == 1 and flags.count(USERS_OPTION) == 1


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.3.2"])
def test_other_vllm_versions_are_refused(version):
    with pytest.raises(UnsupportedVllmVersion, match=rf"supports vLLM 0\.32\.x only.*found vLLM {version}"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu"])
def test_032_is_accepted(version):
    assert check_vllm_version(version) == version


def test_installed_vllm_is_supported():
    check_vllm_version()


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
    ],
)
def test_unsupported_configurations_are_refused(mutate, option):
    config = _limited_config()
    mutate(config)
    with pytest.raises(OutputRateConfigError) as err:
        plugin.configure_output_rate(config)
    assert option in str(err.value)
    assert DEFAULT_OPTION in str(err.value)


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
