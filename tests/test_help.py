"""Help like vLLM's: the project's options in one group with a one-token
title (``serve --help=<title>`` lists every one of them, ``serve --help``
gives vLLM's hint), the two main options under ``--output-rate-`` names
beside their first spellings, ``twin --help`` listing its subcommands,
tools' help said once and without reStructuredText markup, ``-v``."""

from __future__ import annotations

import argparse
import importlib
import json
import re

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_output_rate import plugin
from vllm_output_rate.access import ADMIN_KEYS_OPTION
from vllm_output_rate.config import DEFAULT_OPTION, DEFAULT_OPTION_ALIAS, USERS_OPTION, USERS_OPTION_ALIAS
from vllm_output_rate.frontend import API_KEYS_OPTION, HEADER_OPTION
from vllm_output_rate.internals import serve_cli
from vllm_output_rate.request_fields import USER_SOURCES_OPTION
from vllm_output_rate.shared_settings import SHARED_STATE_OPTION
from vllm_output_rate.tools import cli
from vllm_output_rate.tools.common.help_text import description_and_epilog, plain
from vllm_output_rate.user_label import LABEL_OPTION

#: reStructuredText a terminal would show as is
RST = re.compile(r"``|:[a-z]+:`")


@pytest.fixture
def search(monkeypatch):
    """vLLM keeps a ``--help=`` keyword on its parser class: put it back."""
    monkeypatch.setattr(FlexibleArgumentParser, "_search_keyword", None)


def serve_parser():
    plugin.register()
    return cli.serve_parser(serve_cli()[0], FlexibleArgumentParser)


def help_of(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        parser.parse_args(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def project_options(parser) -> list[str]:
    """The option strings the plugin adds, as its group holds them."""
    (group,) = [g for g in parser._action_groups if g.title == plugin.GROUP_TITLE]
    return [o for a in group._group_actions for o in a.option_strings]


def test_the_group_title_is_one_token_as_vllm_names_its_groups():
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", plugin.GROUP_TITLE)
    titles = [g.title for g in serve_parser()._action_groups]
    assert "ModelConfig" in titles and titles.count(plugin.GROUP_TITLE) == 1


def test_help_for_the_group_lists_every_option_of_the_project(search, capsys):
    parser = serve_parser()
    options = project_options(parser)
    # the group holds what add_output_rate_args adds, and every option of the
    # serve parser named after the project
    alone = plugin.add_output_rate_args(argparse.ArgumentParser(add_help=False))
    assert sorted(options) == sorted(o for a in alone._actions for o in a.option_strings)
    named = {o for a in parser._actions for o in a.option_strings if o.startswith("--output-rate-")}
    assert named <= set(options)
    for known in (DEFAULT_OPTION, DEFAULT_OPTION_ALIAS, USERS_OPTION, USERS_OPTION_ALIAS,
                  "--output-rate-limits-file", SHARED_STATE_OPTION, HEADER_OPTION, API_KEYS_OPTION,
                  ADMIN_KEYS_OPTION, LABEL_OPTION, USER_SOURCES_OPTION):
        assert known in options, known
    for keyword in (plugin.GROUP_TITLE, plugin.GROUP_TITLE.lower()):
        text = help_of(parser, [f"--help={keyword}"], capsys)
        assert text.startswith(f"{plugin.GROUP_TITLE}:")
        missing = [o for o in options if o not in text]
        assert not missing, missing
        assert "--max-model-len" not in text  # the group only
        assert not RST.search(text)
    # vLLM's search by option name finds every one under the common prefix
    text = help_of(parser, ["--help=output-rate"], capsys)
    assert all(o in text for o in options if o.startswith("--output-rate-"))
    assert all(any(n.startswith("--output-rate-") for n in a.option_strings)
               for a in parser._actions if set(a.option_strings) & set(options))


def test_serve_help_prints_vllms_hint(search, capsys):
    text = help_of(serve_parser(), ["--help"], capsys)
    assert "--help=all" in text and f"--help={plugin.GROUP_TITLE}" in text
    assert "vllm-output-rate serve --help=max-model-len" in text
    groups = text.split("Config Groups:")[1]
    assert re.search(rf"^  {plugin.GROUP_TITLE} +Per-user output-token rate limits", groups, re.M)
    assert len(text.splitlines()) < 80  # the groups, not every option
    assert not RST.search(text)


def test_the_new_names_and_the_old_ones_set_the_same_option(search):
    parser = serve_parser()
    users = json.dumps({"a": 5})
    new = parser.parse_args([DEFAULT_OPTION, "7", USERS_OPTION, users])
    old = parser.parse_args([DEFAULT_OPTION_ALIAS, "7", USERS_OPTION_ALIAS, users])
    for args in (new, old):
        assert args.default_user_output_tokens_per_second == "7"
        assert args.user_output_tokens_per_second == users
    assert DEFAULT_OPTION.startswith("--output-rate-") and USERS_OPTION.startswith("--output-rate-")


@pytest.mark.parametrize("flag", ["-v", "--version", "-V"])
def test_the_version_flags(flag, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([flag])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("vllm-output-rate 0.1.0, vLLM ")
    assert "vllm-output-rate -v|--version" in cli.usage()  # -V: kept, not shown


def test_twin_help_lists_its_subcommands_each_a_real_one(search, capsys):
    from vllm_output_rate.tools.twin import cli as twin

    assert twin.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert set(twin.SUBCOMMANDS) == {"run", "compare", "workload", "calibrate", "accuracy", "scale"}
    for name, line in twin.SUBCOMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(line)}$", text, re.M), name
        try:
            code = twin.main([name, "--help"])
        except SystemExit as exc:  # argparse's own --help
            code = exc.code
        assert code == 0, name
        assert not RST.search(capsys.readouterr().out), name
    assert twin.main(["nosuch"]) == 2


def test_twin_run_help_reads_in_a_screen_and_its_groups_list_the_options(search, capsys):
    from vllm_output_rate.tools.twin.config import build_parser

    parser = build_parser()
    text = help_of(parser, ["--help"], capsys)
    assert len(text.splitlines()) < 70, len(text.splitlines())
    assert "--help=Twin" in text and f"--help={plugin.GROUP_TITLE}" in text
    own = help_of(parser, ["--help=Twin"], capsys)
    for option in ("--workload", "--out", "--step-time", "--no-plots", "--until"):
        assert option in own
    limits = help_of(parser, [f"--help={plugin.GROUP_TITLE}"], capsys)
    assert DEFAULT_OPTION in limits and "--max-num-seqs" not in limits


@pytest.mark.parametrize("command", [c for c in cli.COMMANDS if c != "twin"])
def test_each_commands_help_says_its_description_once_without_markup(command, capsys):
    module = importlib.import_module(cli.COMMANDS[command][0])
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert not RST.search(text), [line for line in text.splitlines() if RST.search(line)]
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
    assert len(paragraphs) == len(set(paragraphs)), command


def test_plain_strips_roles_and_literals_and_keeps_the_rest():
    assert plain("``serve`` runs :class:`vllm.Scheduler` and :func:`~a.b`") == (
        "serve runs vllm.Scheduler and a.b")
    assert plain("``a\nb`` and `one` tick") == "a\nb and `one` tick"
    assert description_and_epilog("First\nline.\n\nRest.\n\nMore.") == ("First\nline.", "Rest.\n\nMore.")
