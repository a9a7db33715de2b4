"""Counts that count what they say: the card's and --json's count of the modules
the ignore list leaves in 16 bits, beside the per-pattern counts; verify's title of a bf16 output;
a check group that ran nothing does not say it passed."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

import mla_convert
from mla_convert.cli.app import app
from mla_convert.process import interrupts
from mla_runtime.safetensors_file import read_header

EXPERTS = r"model\.layers\.\d+\.mlp\.experts\."
runner = CliRunner()


def _linears_in_16_bits(out) -> list[str]:
    return sorted(
        name
        for shard in out.glob("*.safetensors")
        for name, t in read_header(shard).tensors.items()
        if name.endswith(".weight") and len(t.shape) == 2 and t.dtype == "BF16" and "embed_tokens" not in name
    )


def test_the_card_and_json_count_the_linears_the_ignore_list_leaves_in_16_bits(tiny_src, tmp_path):
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--ignore", EXPERTS, "--json", "--quiet"])
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    left = _linears_in_16_bits(out)
    experts = [n for n in left if re.match(EXPERTS, n)]
    assert len(experts) == summary["ignored_by_pattern"][EXPERTS] > 0
    assert summary["ignored_modules"] == len(left) > len(experts)  # the experts and lm_head, the gates, ...
    card = (out / "README.md").read_text()
    assert f"whose `ignore` list names the {len(left)} modules left in 16 bits" in card


def test_verify_titles_a_bf16_output_without_a_target(tiny_src, tmp_path):
    out = tmp_path / "out"
    mla_convert.convert(tiny_src, out, format="bf16")
    r = runner.invoke(app, ["verify", str(out)])
    assert r.exit_code == 0, r.stderr
    assert "verify (bf16)" in r.stdout and "bf16 / gaudi3" not in r.stdout
    fp8 = tmp_path / "fp8"
    mla_convert.convert(tiny_src, fp8, target="gaudi2")
    assert "verify (channel-fp8 / gaudi2)" in runner.invoke(app, ["verify", str(fp8)]).stdout


def test_a_group_that_checked_nothing_does_not_say_it_passed(tiny_src, tmp_path, monkeypatch):
    def stop(name: str) -> None:
        if name.startswith("shard-write"):
            raise KeyboardInterrupt

    monkeypatch.setattr(interrupts.CRASH_POINTS, "hook", stop)
    out = tmp_path / "out"
    try:
        mla_convert.convert(tiny_src, out)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(interrupts.CRASH_POINTS, "hook", None)
    report = mla_convert.verify(out)
    assert not report.ok
    for group in ("values", "mla"):
        g = report.groups[group]
        assert g.checked == 0 and g.skipped == "nothing was checked", group
    r = runner.invoke(app, ["verify", str(out)])
    rows = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") > 3}
    assert "pass" not in rows["values"] and "pass" not in rows["mla"], r.stdout
    assert "nothing was checked" in rows["values"]
