"""--ignore: a pattern that matches no linear is an error listing a few linear names; the
summary and --json say, per pattern, how many linears it kept unquantized."""

import json

from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.plan.ignore import check_patterns, convertible_linears, examples, kept_by_pattern
from mla_convert.plan.planner import make_plan
from mla_convert.settings import Options
from mla_convert.source.checkpoint import open_source

runner = CliRunner()
EXPERTS = r"model\.layers\.\d+\.mlp\.experts\."
SHARED = r"model\.layers\.\d+\.mlp\.(shared_)?experts"


def test_a_pattern_that_matches_no_linear_is_refused_with_examples(tiny_src, tmp_path):
    """Before: `--ignore 'nomatch\\.'` exited 0 and the pattern went into the config's ignore list."""
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--ignore", EXPERTS, "--ignore", "nomatch\\."])
    assert r.exit_code == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: --ignore 'nomatch\\.' matches none of the 104 linears this conversion quantizes")
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in line and "model.layers.1.mlp.experts.0.down_proj" in line
    assert not out.exists()
    r = runner.invoke(app, ["convert", str(tiny_src), "--out", str(out), "--dry-run", "--ignore", "mlp\\.experts"])
    assert r.exit_code == 2 and "matches none" in r.stderr  # matched at the start of the name, as the planner does


def test_the_summary_and_json_count_the_linears_each_pattern_kept(tiny_src, tmp_path, load_json, monkeypatch):
    out = tmp_path / "out"
    args = ["convert", str(tiny_src), "--out", str(out), "--ignore", EXPERTS, "--ignore", SHARED]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    src = open_source(tiny_src)
    experts = {m for m in convertible_linears(make_plan(src, Options())) if ".mlp.experts." in m}
    shared = {m for m in convertible_linears(make_plan(src, Options())) if ".mlp.shared_experts." in m}
    assert summary["ignored_by_pattern"] == {EXPERTS: len(experts), SHARED: len(experts) + len(shared)}
    keys = list(summary)
    assert keys.index("ignored_by_pattern") == keys.index("ignored_modules") + 1
    config_ignore = load_json(out / "config.json")["quantization_config"]["ignore"]
    assert f"re:{EXPERTS}" in config_ignore and f"re:{SHARED}" in config_ignore
    monkeypatch.setenv("COLUMNS", "200")  # the table's rows unfolded
    r = runner.invoke(app, [*args[:3], str(tmp_path / "dry"), *args[4:], "--dry-run"])
    rows = [ln for ln in r.stdout.splitlines() if "linears: " in ln]
    assert "left unquantized by --ignore" in rows[0] and f"{len(experts)} linears: {EXPERTS}" in rows[0]
    assert f"{len(experts) + len(shared)} linears: {SHARED}" in rows[1]


def test_a_bf16_sources_linears_are_the_ones_channel_fp8_would_quantize(family_checkpoints):
    src = open_source(family_checkpoints.source("deepseek-v2-lite"))
    plan = make_plan(src, Options(ignore=(r"model\.layers\.\d+\.self_attn\.",)))
    linears = convertible_linears(plan)
    assert linears and not any("embed_tokens" in m or "lm_head" in m or "norm" in m for m in linears)
    attention = [m for m in linears if ".self_attn." in m]
    assert check_patterns(plan) == kept_by_pattern(plan) == {r"model\.layers\.\d+\.self_attn\.": len(attention)}


def test_examples_are_one_of_each_kind_in_layer_order():
    modules = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1, 10) for p in ("q_proj", "o_proj")]
    modules += ["model.layers.2.mlp.experts.7.up_proj", "model.layers.2.mlp.experts.8.up_proj"]
    assert examples(modules) == ["model.layers.0.self_attn.q_proj", "model.layers.2.mlp.experts.7.up_proj"]


def test_patterns_are_matched_in_vllms_module_names_for_a_mistral_native_source(family_checkpoints):
    """Mistral's own layout names its modules `layers.N.experts.E.w1`; the planner matches --ignore
    against vLLM's names (with a vision encoder `language_model.model.layers.N.mlp.experts.E.gate_proj`),
    and the count and the refusal's examples use the same names."""
    src = open_source(family_checkpoints.source("mistral-large-3"))
    pattern = r"language_model\.model\.layers\.\d+\.mlp\.experts\."
    plan = make_plan(src, Options(ignore=(pattern,)))
    linears = convertible_linears(plan)
    assert linears and all(m.startswith("language_model.model.layers.") for m in linears)
    experts = [m for m in linears if ".mlp.experts." in m]
    assert check_patterns(plan) == {pattern: len(experts)} and experts
    assert not any(".mlp.experts." in m for m in plan.ignore if not m.startswith("re:"))
