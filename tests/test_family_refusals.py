"""Checkpoints that are not this tool's (shared/reference/model-family.md): each refused in one line
that says what the checkpoint is and why it is not converted, with exit 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_convert.errors import SourceError
from mla_convert.source.checkpoint import open_source
from support.cli_runner import cli_error


def _set_architecture(root: Path, architectures: list[str], model_type: str) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = architectures, model_type
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "architectures,model_type,what,why",
    [
        (["DeepseekV4ForCausalLM"], "deepseek_v4", "DeepSeek-V4", "it has no kv_b_proj"),
        (["DeepseekV41ForCausalLM"], "deepseek_v4", "DeepSeek-V4", "no latent up-projection to precompute"),
        (["Glm5NextForConditionalGeneration"], "glm5_next", "GLM-5.3-Flash", "HPUMLAAttention) does not serve it"),
        (["KimiK3ForConditionalGeneration"], "kimi_k3", "Kimi-K3", "linear attention"),
        (["KimiLinearForCausalLM"], "kimi_linear", "Kimi-Linear", "linear attention"),
        (["LongcatFlashForCausalLM"], "longcat_flash", "LongCat-Flash", "two attention blocks per layer"),
        ([], "glm5_next", "GLM-5.3-Flash", "is not converted by mla-convert"),  # by model_type alone
    ],
)
def test_a_non_member_is_refused_saying_what_it_is_and_why(src_copy, tmp_path, architectures, model_type, what, why):
    _set_architecture(src_copy, architectures, model_type)
    line = cli_error(["convert", src_copy, "--out", tmp_path / "o"], tmp_path / "o")
    assert f"{what} (" in line and "is not converted by mla-convert" in line and why in line
    assert "expected one of" not in line  # not the generic "not a supported MLA model"


def test_deepseek_v4_says_vllm_gaudi_does_not_serve_it(src_copy):
    _set_architecture(src_copy, ["DeepseekV4ForCausalLM"], "deepseek_v4")
    with pytest.raises(SourceError, match=r"vllm-gaudi's MLA layer \(HPUMLAAttention\) does not serve it"):
        open_source(src_copy)


def test_verify_of_a_directory_with_a_non_member_config_fails_its_config_check(converted, tmp_path):
    import shutil

    from mla_convert.verification import verify

    out = Path(shutil.copytree(converted["bf16"], tmp_path / "out"))
    _set_architecture(out, ["KimiLinearForCausalLM"], "kimi_linear")
    report = verify(out)
    assert not report.ok and any(f.check == "config" for f in report.groups["structure"].failures)
