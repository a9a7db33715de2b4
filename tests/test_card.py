"""The output's model card (README.md): its metadata read back with huggingface_hub's ModelCard, the
source's card kept below it, the manifest recording it, `--no-card`, and verify's check of it."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard import metadata_load
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_convert.constants import MANIFEST_NAME
from mla_convert.conversion.pipeline import convert
from mla_convert.demo.run import run_demo
from mla_convert.output.card import record_verification
from mla_convert.output.card_facts import source_ref
from mla_convert.output.card_text import SOURCE_HEADING, VERIFY_BEGIN, VERIFY_END
from mla_convert.settings import Options
from mla_convert.verification import verify

FP8, BF16 = "channel-fp8", "bf16"
CARD = "README.md"


def card_of(out: Path) -> ModelCard:
    return ModelCard.load(out / CARD)  # a Path: read locally, never downloaded


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_body(src: Path) -> str:
    """The source card's text below its front matter, as huggingface_hub splits it."""
    return ModelCard.load(src / CARD).text.strip("\n")


def test_channel_fp8_card_names_base_model_relation_license_and_tags(converted, tiny_src, load_json):
    out = converted[FP8]
    meta = card_of(out).data.to_dict()
    source_meta = metadata_load(tiny_src / CARD)
    assert source_meta["license"] == "mit"  # the demo source card carries what a published one does
    # A local source with no Hub id and a card naming no base: no base_model (never its path), so no relation.
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert str(tiny_src) not in (out / CARD).read_text()  # no local path in a public card
    for key in ("license", "library_name", "pipeline_tag"):
        assert meta[key] == source_meta[key], key
    assert meta["tags"] == ["fp8", "compressed-tensors", "gaudi", "mla-convert", "deepseek_v3"]
    manifest = load_json(out / MANIFEST_NAME)
    own = meta["mla_convert"]
    assert own["format"] == FP8 and own["target"] == "gaudi3" and own["ignore"] == []
    assert own["source_fingerprint"] == manifest["source_fingerprint"]
    assert manifest["options"]["card"] is True
    assert manifest["source"] == {"path": str(tiny_src.absolute()), "base_model": None}
    assert manifest["files"][CARD] == {"size": (out / CARD).stat().st_size, "sha256": sha256_of(out / CARD)}


def test_bf16_card_has_no_quantized_relation_and_no_fp8_tags(converted):
    meta = card_of(converted[BF16]).data.to_dict()
    assert "base_model_relation" not in meta
    assert "fp8" not in meta["tags"] and "compressed-tensors" not in meta["tags"] and "bf16" in meta["tags"]
    assert meta["mla_convert"]["format"] == BF16


def test_card_body_describes_the_conversion_and_keeps_the_source_card_below_a_heading(converted, tiny_src):
    card = card_of(converted[FP8])
    text = card.text
    top, _, below = text.partition(SOURCE_HEADING)
    assert below, "the source's card is kept under its own heading"
    assert below.rstrip("\n").endswith(source_body(tiny_src))  # unchanged
    for needed in ("## Conversion", "## MLA artifacts", "## Serving", "## Verification", "## What was not verified",
                   "`mla-convert`", "--tensor-parallel-size", "mla_runtime", "No Gaudi hardware",
                   "2.61 %", "0.17 %", card.data.to_dict()["mla_convert"]["source_fingerprint"]):  # fmt: skip
        assert needed in top, needed
    assert "not run when this card was written" in top  # convert does not verify
    serving = top.partition("## Serving")[2].partition("## Verification")[0]
    assert "<" not in serving and "MLA_RUNTIME_DIR" not in serving  # no placeholder, no needless step
    assert 'vllm serve "$PWD"' in serving and "mla-convert upload" in serving


def test_no_card_keeps_the_source_readme_and_verify_passes(tiny_src, tmp_path, load_json):
    out = tmp_path / "out"
    convert(tiny_src, out, Options(card=False))
    assert (out / CARD).read_bytes() == (tiny_src / CARD).read_bytes()
    assert load_json(out / MANIFEST_NAME)["options"]["card"] is False
    assert verify(out).ok


def test_no_card_on_the_command_line(tiny_src, tmp_path, load_json):
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["convert", str(tiny_src), "--out", str(out), "--no-card", "--quiet"])
    assert r.exit_code == 0, r.stderr
    assert (out / CARD).read_bytes() == (tiny_src / CARD).read_bytes()
    assert load_json(out / MANIFEST_NAME)["options"]["card"] is False


def test_resume_with_another_card_choice_is_refused(tiny_src, tmp_path):
    out = tmp_path / "out"
    convert(tiny_src, out, Options())
    r = CliRunner().invoke(app, ["convert", str(tiny_src), "--out", str(out), "--no-card", "--resume", "--quiet"])
    assert r.exit_code == 2 and "card recorded True, requested False" in r.stderr


def test_source_metadata_is_taken_as_it_is_and_a_broken_front_matter_kept_whole(src_copy, tmp_path):
    (src_copy / CARD).write_text(
        "---\nlicense: other\nlicense_name: deepseek\nlicense_link: LICENSE\nlibrary_name: transformers\n"
        "tags: [from-the-source]\nbase_model: someone/else\n---\n\n# The source\n\nBlock FP8, 128x128 scales.\n"
    )
    out = tmp_path / "a"
    convert(src_copy, out, Options())
    meta = card_of(out).data.to_dict()
    assert (meta["license"], meta["license_name"], meta["license_link"]) == ("other", "deepseek", "LICENSE")
    assert meta["base_model"] == "someone/else"  # a fine-tune's card names its base: the Hub id there is
    assert meta["base_model_relation"] == "quantized"
    assert "from-the-source" not in meta["tags"]  # its tags describe the source's weights
    assert card_of(out).text.rstrip().endswith("Block FP8, 128x128 scales.")

    broken = "---\nlicense: [unclosed\n---\nStill the source's text.\n"
    (src_copy / CARD).write_text(broken)
    out = tmp_path / "b"
    convert(src_copy, out, Options())
    meta = card_of(out).data.to_dict()
    assert "license" not in meta and "base_model" not in meta
    assert card_of(out).text.rstrip().endswith(broken.rstrip())
    assert verify(out).ok


def test_a_source_without_readme_gets_a_card_without_a_source_section(src_copy, tmp_path):
    (src_copy / CARD).unlink()
    out = tmp_path / "out"
    convert(src_copy, out, Options())
    card = card_of(out)
    assert SOURCE_HEADING not in card.text and "license" not in card.data.to_dict()
    assert verify(out).ok


def test_same_conversion_same_card(converted, tiny_src, tmp_path):
    convert(tiny_src, tmp_path / "again", Options())
    assert (tmp_path / "again" / CARD).read_bytes() == (converted[FP8] / CARD).read_bytes()


def test_source_ref_names_hub_sources_and_cache_snapshots(tmp_path):
    snapshot = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-R1" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    ref = source_ref(snapshot)
    assert (ref.repo_id, ref.revision, ref.path) == ("deepseek-ai/DeepSeek-R1", "ab" * 20, None)
    assert ref.base_model == "deepseek-ai/DeepSeek-R1"
    assert source_ref(tmp_path, "org/x", "c" * 40).label() == f"org/x@{'c' * 40}"
    plain = source_ref(tmp_path / "hub")
    assert plain.repo_id is None and plain.base_model is None and plain.label() == ""
    assert plain.path == str((tmp_path / "hub").absolute())
    assert source_ref(tmp_path / "hub", base_model="org/base").base_model == "org/base"  # --base-model first
    assert source_ref(snapshot, base_model="org/base").base_model == "org/base"


def test_a_hub_source_is_named_by_its_id_and_commit(fake_hub, tiny_src, tmp_path, load_json):
    fake_hub.add_repo("deepseek-ai/Tiny-R1", tiny_src)
    out = tmp_path / "out"
    convert("deepseek-ai/Tiny-R1", out, Options())
    commit = fake_hub.commit_sha("deepseek-ai/Tiny-R1")
    meta = card_of(out).data.to_dict()
    assert meta["base_model"] == "deepseek-ai/Tiny-R1" and meta["mla_convert"]["source_revision"] == commit
    assert load_json(out / MANIFEST_NAME)["source"] == {
        "repo_id": "deepseek-ai/Tiny-R1", "revision": commit, "base_model": "deepseek-ai/Tiny-R1"
    }  # fmt: skip
    assert f"`deepseek-ai/Tiny-R1` at commit `{commit}`" in card_of(out).text
    assert verify(out).ok


# --- verify's check of the card ---------------------------------------------------------------------


@pytest.fixture
def fp8_copy(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted[FP8], tmp_path / "copy"))


def rewrite_card(out: Path, edit, fix_manifest: bool) -> None:
    """Edit the card's metadata with `edit(dict)`; with `fix_manifest`, record its new sha256 (so that
    only the metadata check can catch it)."""
    card = card_of(out)
    data = card.data.to_dict()
    edit(data)
    from huggingface_hub import ModelCardData

    (out / CARD).write_text(str(ModelCard(f"---\n{ModelCardData(**data).to_yaml()}\n---\n{card.text}")))
    if fix_manifest:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        manifest["files"][CARD] = {"size": (out / CARD).stat().st_size, "sha256": sha256_of(out / CARD)}
        (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def card_failures(report) -> list[str]:
    return [f.line() for f in report.failures() if f.check == "card"]


def test_verify_passes_the_card_and_counts_its_checks(converted):
    report = verify(converted[FP8])
    assert report.ok and not card_failures(report)


def test_verify_fails_a_card_that_names_another_source(fp8_copy):
    rewrite_card(fp8_copy, lambda d: d.update(base_model="someone/else"), fix_manifest=True)
    report = verify(fp8_copy)
    assert not report.ok
    failures = [f.line() for f in report.failures()]
    assert failures == card_failures(report) and len(failures) == 1
    assert "base_model" in failures[0] and "someone/else" in failures[0]


def test_verify_fails_a_card_with_another_format_and_a_changed_sha256(fp8_copy):
    rewrite_card(fp8_copy, lambda d: d["mla_convert"].update(format="bf16"), fix_manifest=False)
    report = verify(fp8_copy)
    lines = [f.line() for f in report.failures()]
    assert any("[integrity/sha256] README.md" in ln for ln in lines)
    assert any("[integrity/card] README.md" in ln and "format 'bf16'" in ln for ln in lines)


def test_verify_fails_a_card_the_manifest_does_not_list_or_without_metadata(fp8_copy):
    manifest = json.loads((fp8_copy / MANIFEST_NAME).read_text())
    del manifest["files"][CARD]
    (fp8_copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    lines = card_failures(verify(fp8_copy))
    assert lines and "not listed" in lines[0]

    manifest["files"][CARD] = {}
    (fp8_copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    (fp8_copy / CARD).write_text("# no metadata\n")
    lines = card_failures(verify(fp8_copy))
    assert lines and "no metadata" in lines[0]


def test_recording_a_verify_result_updates_card_and_manifest(fp8_copy, tiny_src):
    before = (fp8_copy / CARD).read_text()
    report = verify(fp8_copy, tiny_src)
    assert report.ok
    written = record_verification(fp8_copy, report)
    after = (fp8_copy / CARD).read_text()
    section = after[after.index(VERIFY_BEGIN) : after.index(VERIFY_END)]
    assert "**Result**: PASS" in section and str(tiny_src) in section
    for name, group in report.groups.items():
        assert f"| {name} | {group.checked} | 0 | pass |" in section
    outside = lambda s: s[: s.index(VERIFY_BEGIN)] + s[s.index(VERIFY_END) :]  # noqa: E731
    assert outside(after) == outside(before)
    assert json.loads((fp8_copy / MANIFEST_NAME).read_text())["files"][CARD]["sha256"] == written.sha256
    assert verify(fp8_copy).ok


def test_demo_card_parses_with_the_metadata_and_records_the_verify_result(tmp_path):
    result = run_demo(tmp_path / "demo", Options())
    assert result.report.ok
    card = card_of(Path(result.conversion.out))
    meta = card.data.to_dict()
    assert meta["license"] == "mit"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"fp8", "compressed-tensors", "gaudi", "mla-convert", "deepseek_v3"} <= set(meta["tags"])
    assert "base_model" not in meta and "base_model_relation" not in meta  # a synthetic source has no Hub id
    assert "**Result**: PASS" in card.text
    assert verify(result.conversion.out).ok  # the manifest follows the rewritten card


@pytest.mark.parametrize(
    "member, config_name, fmt, int4",
    [("mistral-large-3", "params.json", FP8, False), ("kimi-k2-thinking", "config.json", FP8, True),
     ("kimi-k2-thinking", "config.json", BF16, True)],
)  # fmt: skip
def test_late_2026_cards_name_their_config_file_and_the_int4_experts(tmp_path, member, config_name, fmt, int4):
    result = run_demo(tmp_path / "demo", Options(format=fmt), member=member)
    assert result.report.ok
    out = Path(result.conversion.out)
    text = card_of(out).text
    other = "config.json" if config_name == "params.json" else "params.json"
    assert f"`{config_name}`" in text and f"`{other}`" not in text
    assert ("INT4" in text) == int4
    if int4 and fmt == FP8:
        assert "copied bit for bit, never requantized" in text
    assert verify(out).ok
