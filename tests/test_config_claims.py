"""The output's quantization_config says what each linear is, for every member: every linear
left in 16 bits is in `ignore`, every FP8 one is not (and a group targets it), as compressed-tensors'
own matching reads the entries; and the card's count of the modules `ignore` names is that
number."""

from __future__ import annotations

import json

import pytest
from compressed_tensors.utils.match import match_name

from mla_convert.source import members
from mla_convert.source.model_config import read_model_config
from mla_runtime.safetensors_file import read_header

MEMBERS = members.demo_members()


def _linears(out) -> dict[str, str]:
    """Every 2-D `X.weight` of the output's shards but the token embeddings, by the module name
    vLLM matches (the member's own names mapped): its dtype."""
    model = read_model_config(out)
    found = {}
    for shard in sorted(out.glob("*.safetensors")):
        for name, t in read_header(shard).tensors.items():
            module = name.removesuffix(".weight")
            if (
                name.endswith(".weight")
                and len(t.shape) == 2
                and not module.endswith(("embed_tokens", "tok_embeddings"))
            ):
                found[model.names.config_module(module)] = t.dtype
    return found


@pytest.mark.parametrize("member", MEMBERS)
def test_ignore_names_exactly_the_linears_left_in_16_bits(family_checkpoints, member):
    out = family_checkpoints.converted(member, "channel-fp8")
    qc = read_model_config(out).quantization
    ignore = qc["ignore"]
    linears = _linears(out)
    in_16_bits = sorted(m for m, dtype in linears.items() if dtype in ("BF16", "F16", "F32"))
    fp8 = sorted(m for m, dtype in linears.items() if dtype == "F8_E4M3")
    assert in_16_bits and fp8
    not_ignored = [m for m in in_16_bits if not any(match_name(m, e) for e in ignore)]
    assert not not_ignored, f"{member}: 16-bit linears the config's Linear target claims: {not_ignored[:5]}"
    ignored_fp8 = [m for m in fp8 if any(match_name(m, e) for e in ignore)]
    assert not ignored_fp8, f"{member}: FP8 linears the config ignores: {ignored_fp8[:5]}"
    assert any("Linear" in g["targets"] for g in qc["config_groups"].values())
    # The card's sentence counts them: "whose `ignore` list names the N modules left in 16 bits".
    record = json.loads((out / "mla-convert-manifest.json").read_text())["card"]
    assert record["ignored_modules"] == len(in_16_bits), member
    card = (out / "README.md").read_text()
    assert f"names the {len(in_16_bits)} modules left in 16 bits" in card
