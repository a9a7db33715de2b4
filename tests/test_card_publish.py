"""The card as the Hub takes it: base_model a Hub model id or absent (never a path), set by
--base-model or later by `mla-convert card`; every member's card, and cards from real source card
metadata, accepted by the fake Hub's validate-yaml (as strict as the Hub for these fields), through
the real client's ModelCard.validate; what the fake Hub refuses, with the Hub's kind of message."""

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import mla_convert
from mla_convert.cli.app import app
from mla_convert.constants import MANIFEST_NAME
from mla_convert.conversion.pipeline import convert
from mla_convert.errors import OutputError
from mla_convert.settings import Options
from mla_convert.source.family import demo_members
from mla_convert.verification import verify
from support.fake_hub_upload import front_matter_errors

CARD = "README.md"
BASE = "deepseek-ai/DeepSeek-R1"
R1_CARD = "---\nlicense: mit\nlibrary_name: transformers\n---\n# DeepSeek-R1\n\nThe source's text.\n"
K2_CARD = (
    "---\nlicense: other\nlicense_name: modified-mit\nlibrary_name: transformers\n---\n"
    '<div align="center"><picture><img src="figures/kimi-logo.png" width="30%"></picture></div>\n\n'
    "# Kimi K2\n"
)


def meta_of(out: Path) -> dict:
    return ModelCard.load(out / CARD).data.to_dict()


def manifest_of(out: Path) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())


def validate(path: Path) -> None:
    """The real client's validation: POST /api/validate-yaml of the fake Hub; ValueError if refused."""
    ModelCard.load(path).validate()


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)])


def card_only(out: Path, to: Path) -> Path:
    """The card and the manifest of `out`, all that `mla-convert card` reads, in a directory of their own."""
    to.mkdir()
    for name in (CARD, MANIFEST_NAME):
        shutil.copy(out / name, to / name)
    return to


# --- base_model ------------------------------------------------------------------------------------


def test_a_local_source_with_no_hub_id_gets_no_base_model_and_the_summary_says_how_to_set_it(src_copy, tmp_path):
    out = tmp_path / "out"
    r = cli("convert", src_copy, "--out", out)
    assert r.exit_code == 0, r.stderr
    meta = meta_of(out)
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert str(src_copy) not in (out / CARD).read_text()
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("note:")]  # in the summary; stderr: no note
    assert [" ".join(n.split()) for n in notes] == [
        f"note: the model card names no base model (the source is a local directory with no Hub id); "
        f"set it with `mla-convert card {out} --base-model OWNER/NAME`"
    ] and "note" not in r.stderr
    assert front_matter_errors(meta) == []


def test_base_model_on_convert_is_recorded_and_verified(src_copy, tmp_path):
    out = tmp_path / "out"
    r = cli("convert", src_copy, "--out", out, "--base-model", BASE, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["base_model"] == BASE and "base_model_hint" not in json.loads(r.stdout)
    meta = meta_of(out)
    assert meta["base_model"] == BASE and meta["base_model_relation"] == "quantized"
    assert manifest_of(out)["source"] == {"path": str(src_copy.absolute()), "base_model": BASE}
    text = (out / CARD).read_text()
    assert f"[`{BASE}`](https://huggingface.co/{BASE}) converted to channel FP8" in text
    assert f"| source | a local directory; base model `{BASE}` |" in text
    assert verify(out).ok
    bf16 = tmp_path / "bf16"
    convert(src_copy, bf16, Options(format="bf16", base_model=BASE))
    assert meta_of(bf16)["base_model"] == BASE and "base_model_relation" not in meta_of(bf16)  # a dtype copy


@pytest.mark.parametrize("bad", ["/data/DeepSeek-R1", "./R1", "https://huggingface.co/deepseek-ai/DeepSeek-R1", "",
                                 "R1", "a/b/c", "org/a--b"])  # fmt: skip
def test_a_base_model_that_is_not_a_hub_id_is_refused_in_one_line(src_copy, tmp_path, bad):
    r = cli("convert", src_copy, "--out", tmp_path / "out", "--base-model", bad)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "expected a Hub model id" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


# --- mla-convert card -------------------------------------------------------------------------------


def test_card_sets_base_model_later_as_convert_would_have_and_verify_passes(converted, src_copy, tmp_path):
    out = Path(shutil.copytree(converted["channel-fp8"], tmp_path / "out"))
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name not in (CARD, MANIFEST_NAME)}
    r = cli("card", out, "--base-model", BASE)
    assert r.exit_code == 0, r.stderr
    assert meta_of(out)["base_model"] == BASE and manifest_of(out)["source"]["base_model"] == BASE
    assert verify(out).ok
    # The card and the manifest's record of it are byte for byte what a conversion with --base-model writes.
    direct = tmp_path / "direct"
    convert(src_copy, direct, Options(base_model=BASE))
    assert (out / CARD).read_bytes() == (direct / CARD).read_bytes()
    assert manifest_of(out)["files"] == manifest_of(direct)["files"]
    after = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name not in (CARD, MANIFEST_NAME)}
    assert after == before  # nothing else changed
    again = mla_convert.card(out)
    assert not again.changed and again.base_model == BASE


def test_card_for_a_repo_names_it_in_the_download_and_serve_lines(converted, tmp_path):
    out = Path(shutil.copytree(converted["channel-fp8"], tmp_path / "out"))
    result = mla_convert.card(out, repo_id="org/R1-channel-fp8")
    text = (out / CARD).read_text()
    assert result.changed and result.repo_id == "org/R1-channel-fp8" and result.base_model is None
    assert "\n# R1-channel-fp8\n" in text and "vllm serve org/R1-channel-fp8 --tensor-parallel-size" in text
    assert "hf download org/R1-channel-fp8 --local-dir ./R1-channel-fp8" in text and "$PWD" not in text
    assert verify(out).ok
    kept = mla_convert.card(out, base_model=BASE)  # the recorded repo stays
    assert kept.repo_id == "org/R1-channel-fp8" and "vllm serve org/R1-channel-fp8" in (out / CARD).read_text()


def test_card_keeps_a_recorded_verify_result_and_the_source_card(tmp_path):
    from mla_convert.demo.run import run_demo

    demo = run_demo(tmp_path / "demo", Options())
    out = Path(demo.conversion.out)
    old = (out / CARD).read_text()
    mla_convert.card(out, base_model=BASE)
    new = (out / CARD).read_text()
    assert (
        "**Result**: PASS" in new
        and new.split("<!-- mla-convert:source-card -->")[1] == old.split("<!-- mla-convert:source-card -->")[1]
    )
    assert verify(out).ok


@pytest.mark.parametrize("bad", ["/data/x", "https://hf.co/a/b", ""])
def test_card_refuses_what_is_not_a_hub_id(converted, tmp_path, bad):
    out = card_only(converted["channel-fp8"], tmp_path / "out")
    r = cli("card", out, "--base-model", bad)
    assert r.exit_code == 2 and "expected a Hub model id" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("card", out, "--repo-id", bad)
    assert r.exit_code == 2 and "expected a Hub model id" in r.stderr


def test_card_refuses_a_no_card_output_and_one_without_recorded_facts(tiny_src, converted, tmp_path):
    plain = tmp_path / "plain"
    convert(tiny_src, plain, Options(card=False))
    with pytest.raises(OutputError, match="converted with card=False"):
        mla_convert.card(plain)
    old = card_only(converted["channel-fp8"], tmp_path / "old")
    manifest = manifest_of(old)
    del manifest["card"]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    r = cli("card", old)
    assert r.exit_code == 2 and "records no facts for the card" in r.stderr and "convert again" in r.stderr


# --- the Hub's validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("member", demo_members())
def test_every_members_card_passes_the_hubs_validation_locally_and_for_a_repo(
    fake_hub, family_checkpoints, tmp_path, member
):
    out = family_checkpoints.converted(member, "channel-fp8")
    validate(out / CARD)
    copy = card_only(out, tmp_path / "for-repo")
    mla_convert.card(copy, repo_id=f"org/{member}-channel-fp8", base_model=BASE)
    validate(copy / CARD)
    text = (copy / CARD).read_text()
    assert "<" + "this repo>" not in text and f"vllm serve org/{member}-channel-fp8" in text
    # vLLM's download leaves mla/ out (the index's shards, or Mistral's consolidated ones): the card fetches it.
    assert f"hf download org/{member}-channel-fp8 --include 'mla/*'\nvllm serve org/{member}-channel-fp8 " in text
    assert ("`consolidated*.safetensors`" in text) == member.startswith("mistral")


@pytest.mark.parametrize("source_card, expected", [
    (R1_CARD, {"license": "mit", "library_name": "transformers"}),
    (K2_CARD, {"license": "other", "license_name": "modified-mit", "library_name": "transformers"}),
])  # fmt: skip
def test_cards_from_real_source_card_metadata_pass(fake_hub, src_copy, tmp_path, source_card, expected):
    (src_copy / CARD).write_text(source_card)
    out = tmp_path / "out"
    convert(src_copy, out, Options(base_model=BASE))
    meta = meta_of(out)
    assert {k: meta.get(k) for k in expected} == expected
    validate(out / CARD)
    assert verify(out).ok


@pytest.mark.parametrize("field, value, said", [
    ("base_model", "/data/DeepSeek-R1", '"base_model" with value "/data/DeepSeek-R1" is not valid. Use a model id'),
    ("base_model", "https://huggingface.co/org/x", '"base_model" with value "https://huggingface.co/org/x" is not'),
    ("base_model", "", '"base_model" with value "" is not valid'),
    ("base_model_relation", "requantized", '"base_model_relation" must be one of adapter, merge, quantized, finetune'),
    ("license", "MIT License", '"license" with value "MIT License" is not valid'),
    ("tags", [1, "fp8"], '"tags" must be an array of strings'),
    ("pipeline_tag", "chat", '"pipeline_tag" with value "chat" is not a valid task'),
])  # fmt: skip
def test_the_fake_hub_refuses_what_the_hub_refuses(fake_hub, converted, tmp_path, field, value, said):
    card = ModelCard.load(converted["channel-fp8"] / CARD)
    setattr(card.data, field, value)
    path = tmp_path / CARD
    path.write_text(str(card))
    with pytest.raises(ValueError) as refused:
        validate(path)
    assert any(said in e["message"] for e in json.loads(str(refused.value))["errors"]), str(refused.value)


def test_license_other_needs_a_license_name(fake_hub, converted, tmp_path):
    card = ModelCard.load(converted["channel-fp8"] / CARD)
    card.data.license = "other"
    path = tmp_path / CARD
    path.write_text(str(card))
    with pytest.raises(ValueError, match=r'license_name\\" is required'):
        validate(path)
    card.data.license_name = "modified-mit"
    path.write_text(str(card))
    validate(path)
