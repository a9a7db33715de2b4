"""The member registry (mla_convert/source/members/): it finds every member module by itself, a new
module is a new member with nothing else edited, and the members' names stay in their modules."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest

from mla_convert.demo.specs import CheckpointSpec
from mla_convert.source import family, members

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mla_convert" / "source" / "members"

# A member that gives layer 1 its own qk_nope_head_dim (a NoPE layer: nope + rope) and drops layer
# 2's kv_a_proj_with_mqa / kv_a_layernorm (a KV-sharing layer), written as a newcomer would.
NEW_MEMBER = """
from mla_convert.source.members.member import Member, SupportedCheckpoint


def _dims(cfg, i):
    return {"qk_nope_head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]} if i == 1 else None


def _inventory(cfg, i, out):
    if i == 2:
        for t in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
            del out[f"model.layers.{i}.self_attn.{t}"]


MEMBER = Member(
    name="test-nope", rank=1000, architecture="TestNopeForCausalLM", short="Test-Nope",
    help_who="Test-Nope (test_nope)", help_what="its layer 1 without RoPE", layer_dims=_dims,
    layer_inventory=_inventory, kept_16bit=r"self_attn\\.kv_b_proj$",
    supported=(SupportedCheckpoint("Test-Nope", "`TestNopeForCausalLM`", "BF16", "as V3", ("test-nope",)),),
    demos={"test-nope": dict(architecture="TestNopeForCausalLM", weights="bf16")},
)
"""


@pytest.fixture
def new_member(tmp_path, monkeypatch):
    """NEW_MEMBER as one more module of the package (on its search path), registry caches cleared."""
    (tmp_path / "test_nope.py").write_text(NEW_MEMBER)
    monkeypatch.setattr(members, "__path__", [*members.__path__, str(tmp_path)])
    members.all_members.cache_clear()
    members.kept_16bit.cache_clear()
    yield
    sys.modules.pop("mla_convert.source.members.test_nope", None)
    members.all_members.cache_clear()
    members.kept_16bit.cache_clear()


def test_every_module_of_the_package_is_a_member_the_registry_finds():
    modules = [m.name for m in pkgutil.iter_modules([str(PACKAGE)]) if m.name != "member"]
    found = {m.name for m in members.all_members()}
    for name in modules:
        member = importlib.import_module(f"mla_convert.source.members.{name}").MEMBER
        assert member.name in found, name
    assert len(found) == len(modules) >= 8
    ranks = [m.rank for m in members.all_members()]
    assert ranks == sorted(set(ranks)), "ranks unique, members in rank order"
    demos = members.demo_members()
    assert len(demos) == len(set(demos)) and set(demos) == {d for s in members.supported() for d in s.demos}


def test_a_new_module_is_a_new_member_with_nothing_else_edited(new_member):
    assert "test-nope" in members.demo_members()
    assert "TestNopeForCausalLM" in family.supported_architectures()
    assert "TestNopeForCausalLM: Test-Nope (test_nope). its layer 1 without RoPE." in family.architectures_help()
    assert members.supported()[-1].checkpoints == "Test-Nope"
    spec = CheckpointSpec.family("test-nope")
    cfg = spec.config()
    inventory = family.implied_tensors(cfg)
    n, p, r, v, l = 4, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    kv_b = "model.layers.{}.self_attn.kv_b_proj.weight"
    assert inventory[kv_b.format(0)] == ((n * (p + v), l), family.LINEAR)  # kept 16-bit, the model's dims
    assert inventory[kv_b.format(1)] == ((n * (p + r + v), l), family.LINEAR)  # its own qk_nope
    assert inventory["model.layers.1.self_attn.q_a_proj.weight"][1] == family.FP8_LINEAR
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight" not in inventory
    assert "model.layers.2.self_attn.kv_b_proj.weight" in inventory
    assert family.layer_config(cfg, "TestNopeForCausalLM", 0) is cfg


def test_todays_members_give_no_layer_dims_of_their_own():
    """So the MLA manifest records none (LayerEntry.dims absent) and their output keeps its bytes."""
    for name in members.demo_members():
        cfg = CheckpointSpec.family(name).config()
        arch = family.ModelLayout.of(cfg).architecture
        assert all(family.layer_config(cfg, arch, i) is cfg for i in range(cfg["num_hidden_layers"])), name


# Names of members, and the files outside the member modules that may still name them: those whose
# owners clean them (kernels/), and constants.py's import of mla_runtime.format's params.json name.
NAMES = ("kimi", "mistral", "glm", "moonlight", "deepseek_v32", "v3.2", "v2-lite", "deepseek_v2")
ELSEWHERE = {"mla_convert/kernels/numerics.py", "mla_convert/constants.py"}


@pytest.mark.parametrize("name", NAMES)
def test_a_member_name_is_in_its_member_modules_only(name):
    files = [p for p in (ROOT / "mla_convert").rglob("*.py") if re.search(re.escape(name), p.read_text(), re.I)]
    outside = {str(p.relative_to(ROOT)) for p in files if PACKAGE not in p.parents}
    inside = [p for p in files if PACKAGE in p.parents]
    assert outside <= ELSEWHERE, sorted(outside - ELSEWHERE)
    assert 1 <= len(inside) <= 2, [p.name for p in inside]
