"""A model card its user edited: `mla-convert card DIR` keeps the user's text
around the sections mla-convert writes and records the new bytes, so that verify and upload pass;
an edit inside those sections is refused, naming README.md, unless --keep or --overwrite says what
to do with it; an edit not recorded fails verify with a hint saying how to record it; upload
publishes the edit (against the local fake Hub, with the real huggingface_hub client)."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, hf_hub_download
from typer.testing import CliRunner

import mla_convert
from mla_convert.cli.app import app
from mla_convert.constants import MANIFEST_NAME
from mla_convert.errors import OutputError
from mla_convert.verification import verify

CARD = "README.md"
REPO = "org/tiny-r1-edited"
INTRO = "Intro by the user, above the title.\n\n"
NOTE = "Our own notes: served on 8 Gaudi3 cards since May.\n\n"
TAIL = "\n## Contact\n\nAsk the user's team.\n"
USER_TEXT = (INTRO.strip(), NOTE.strip(), TAIL.strip())


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)])


def one_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recorded_sha256(out: Path) -> str:
    return json.loads((out / MANIFEST_NAME).read_text())["files"][CARD]["sha256"]


def edit_around(out: Path) -> None:
    """The user's text above the title, between two sections and at the end: outside what mla-convert writes."""
    path = out / CARD
    text = path.read_text()
    text = text.replace("\n---\n\n# ", f"\n---\n\n{INTRO}# ", 1).replace("## Conversion\n", f"{NOTE}## Conversion\n", 1)
    path.write_text(text + TAIL)


def edit_inside(out: Path) -> None:
    """A change of the serve line: inside the Serving section mla-convert writes."""
    path = out / CARD
    text = path.read_text()
    assert "--tensor-parallel-size 4\n" in text
    path.write_text(text.replace("--tensor-parallel-size 4\n", "--tensor-parallel-size 4 --max-model-len 8192\n", 1))


def has_user_text(text: str) -> bool:
    return all(t in text for t in USER_TEXT)


# --- mla-convert card keeps the user's text and records it ----------------------------------------


def test_card_keeps_the_users_text_and_records_it_so_verify_passes(out):
    edit_around(out)
    edited = (out / CARD).read_bytes()
    r = cli("card", out)
    assert r.exit_code == 0, r.stderr
    assert (out / CARD).read_bytes() == edited  # nothing of the user's changed: the bytes are recorded as they are
    assert recorded_sha256(out) == sha256_of(out / CARD)
    assert verify(out).ok
    again = mla_convert.card(out)
    assert not again.changed and (out / CARD).read_bytes() == edited
    # Written for a repo: the serve line names it, the user's text stays, verify still passes.
    mla_convert.card(out, repo_id="org/x")
    text = (out / CARD).read_text()
    assert has_user_text(text) and "vllm serve org/x" in text and '"$PWD"' not in text
    assert text.index(INTRO.strip()) < text.index("# x\n") and text.index(NOTE.strip()) < text.index("## Conversion")
    assert text.endswith(TAIL)
    assert verify(out).ok


def test_the_users_metadata_keys_and_tags_are_kept(out):
    path = out / CARD
    text = path.read_text()
    assert text.startswith("---\n") and "\n- gaudi\n" in text
    path.write_text(
        text.replace("---\n", "---\nlanguage:\n- en\n", 1).replace("\n- gaudi\n", "\n- gaudi\n- reasoning\n", 1)
    )
    assert cli("card", out, "--repo-id", "org/x").exit_code == 0
    meta = ModelCard.load(path).data.to_dict()
    assert meta["language"] == ["en"] and "reasoning" in meta["tags"] and "fp8" in meta["tags"]
    assert verify(out).ok


def test_an_edit_not_recorded_fails_verify_with_the_hint_to_record_it(out):
    edit_around(out)
    report = verify(out)
    assert not report.ok
    lines = [f.line() for f in report.failures() if f.file == CARD and f.check == "sha256"]
    assert len(lines) == 1 and "`mla-convert card DIR`" in lines[0], lines
    r = cli("verify", out)
    assert r.exit_code == 1 and "`mla-convert card DIR` records" in " ".join((r.stdout + r.stderr).split())


def test_an_edit_inside_a_section_is_refused_naming_the_card_unless_keep_or_overwrite(out, tmp_path):
    edit_around(out)
    edit_inside(out)
    before = {name: (out / name).read_bytes() for name in (CARD, MANIFEST_NAME)}
    r = cli("card", out)
    line = one_line(r)
    assert r.exit_code == 2 and str(out / CARD) in line and "## Serving" in line and "--overwrite" in line
    assert {name: (out / name).read_bytes() for name in (CARD, MANIFEST_NAME)} == before  # nothing written
    with pytest.raises(OutputError, match="overwrite=True"):
        mla_convert.card(out)
    assert {name: (out / name).read_bytes() for name in (CARD, MANIFEST_NAME)} == before
    second = Path(shutil.copytree(out, tmp_path / "second"))
    # --overwrite: the section written again; the user's text around it kept.
    r = cli("card", out, "--overwrite")
    assert r.exit_code == 0, r.stderr
    text = (out / CARD).read_text()
    assert "--max-model-len" not in text and "--tensor-parallel-size 4\n" in text and has_user_text(text)
    assert verify(out).ok
    # --keep: the section as the user wrote it; recorded, so later writes keep it too.
    r = cli("card", second, "--keep")
    assert r.exit_code == 0, r.stderr
    assert (second / CARD).read_bytes() == before[CARD] and verify(second).ok
    mla_convert.card(second, base_model="deepseek-ai/DeepSeek-R1")
    text = (second / CARD).read_text()
    assert "--max-model-len 8192" in text and has_user_text(text) and "deepseek-ai/DeepSeek-R1" in text
    assert verify(second).ok


def test_an_edited_identity_key_is_refused_even_with_keep(out):
    path = out / CARD
    path.write_text(path.read_text().replace("format: channel-fp8", "format: bf16", 1))
    r = cli("card", out, "--keep")
    assert r.exit_code == 2 and str(path) in one_line(r) and "--overwrite" in one_line(r)
    assert cli("card", out, "--overwrite").exit_code == 0
    assert "format: channel-fp8" in path.read_text() and verify(out).ok


# --- upload publishes the edit ----------------------------------------------------------------------


def test_an_edited_card_recorded_by_card_is_uploaded_with_the_edit(hub, out, tmp_path):
    edit_around(out)
    assert cli("card", out).exit_code == 0
    r = cli("upload", out, REPO, "--create")
    assert r.exit_code == 0, r.stderr
    on_hub = Path(hf_hub_download(REPO, CARD, cache_dir=tmp_path / "dl")).read_text()
    assert has_user_text(on_hub) and f"vllm serve {REPO}" in on_hub
    assert on_hub == (out / CARD).read_text() and verify(out).ok
    assert hub.tree(REPO)[CARD] == recorded_sha256(out)


def test_an_edit_inside_a_section_kept_with_keep_is_uploaded_as_the_user_wrote_it(hub, out, tmp_path):
    edit_around(out)
    edit_inside(out)
    assert cli("card", out, "--keep").exit_code == 0
    r = cli("upload", out, REPO, "--create")
    assert r.exit_code == 0, r.stderr
    on_hub = Path(hf_hub_download(REPO, CARD, cache_dir=tmp_path / "dl")).read_text()
    assert has_user_text(on_hub) and "--max-model-len 8192" in on_hub and on_hub == (out / CARD).read_text()
    assert f"# {REPO.split('/')[1]}\n" in on_hub  # the title, outside the kept section, names the repo
    assert verify(out).ok


@pytest.mark.parametrize("skip_verify", [(), ("--skip-verify",)])
@pytest.mark.parametrize("edit", [edit_around, edit_inside])
def test_upload_of_an_edit_not_recorded_is_refused_saying_how_to_record_it(hub, out, edit, skip_verify):
    edit(out)
    before = {name: (out / name).read_bytes() for name in (CARD, MANIFEST_NAME)}
    r = cli("upload", out, REPO, "--create", *skip_verify)
    assert r.exit_code != 0 and "`mla-convert card" in " ".join((r.stdout + r.stderr).split()), r.stdout + r.stderr
    assert {name: (out / name).read_bytes() for name in (CARD, MANIFEST_NAME)} == before
    assert hub.count(method="PUT") == 0 and hub.count(kind="create") == 0


# --- a missing directory ----------------------------------------------------------------------------


def test_card_on_a_missing_directory_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(OutputError, match=r"no-such-dir: no such directory$"):
        mla_convert.card(missing)
    r = cli("card", missing)
    assert r.exit_code == 2 and one_line(r) == f"error: {missing}: no such directory"
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        mla_convert.card(tmp_path / "file")
