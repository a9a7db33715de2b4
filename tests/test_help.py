"""--help at 80 columns, through the real CLI: names wrap whole, SOURCE says what Mistral's
layout has, the summary names every kind of source, and every option that takes a value shows it."""

import re

import pytest

from mla_convert.cli.options import DEMO_FAMILIES
from mla_convert.source.members.mistral_large_3 import MEMBER as MISTRAL_LARGE_3_MEMBER

MISTRAL_LARGE_3 = MISTRAL_LARGE_3_MEMBER.architecture

COMMANDS = [(), ("convert",), ("deepseek-r1",), ("demo",), ("verify",), ("upload",)]


def help_at_80(run_cli, *command) -> str:
    r = run_cli(*command, "--help", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "mla-convert")
def test_no_word_is_cut_at_a_hyphen(run_cli, command):
    """Before: `demo --family` ended a line with 'mistral-' and began the next with 'large-3-bf16'."""
    text = help_at_80(run_cli, *command)
    lines = text.splitlines()
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    cut = [ln for ln in lines if re.search(r"[A-Za-z0-9.]-$", ln)]
    assert not cut, cut


def test_demo_family_lists_every_name_whole(run_cli):
    text = help_at_80(run_cli, "demo")
    words = {w.rstrip(".") for w in re.findall(r"[\w.-]+", text)}
    assert all(name in words for name in DEMO_FAMILIES), sorted(set(DEMO_FAMILIES) - words)


def test_demo_out_shows_its_placeholder(run_cli):
    """Before: `-o, --out` with nothing after it, where the other commands show DIR."""
    assert "-o, --out DIR " in help_at_80(run_cli, "demo")
    assert "-o, --out DIR " in help_at_80(run_cli, "convert")


def test_source_help_does_not_say_mistrals_config_json_names_it(run_cli):
    """Before: 'its config.json names one of ..., MistralLarge3ForCausalLM' (Mistral's layout has no config.json)."""
    text = " ".join(help_at_80(run_cli, "convert").split())
    source = text.split("SOURCE Checkpoint", 1)[1].split("[required]")[0]
    says_config_names = source.split("config.json names", 1)[1].split(";")[0]
    assert MISTRAL_LARGE_3 not in says_config_names
    assert "DeepseekV3ForCausalLM" in says_config_names
    assert "Mistral-Large-3 in Mistral's own layout (params.json" in source


def test_the_summary_names_int4_kimi_and_mistral(run_cli):
    """Before: '...; block-FP8 or BF16)' and no Mistral."""
    summary = " ".join(help_at_80(run_cli).split("Options:")[0].split())
    assert "INT4" in summary and "Mistral-Large-3" in summary and "K2.5" in summary
    assert "block-FP8 or BF16" not in summary
