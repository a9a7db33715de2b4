"""`mla-convert upload` against the local fake Hub (tests/support/fake_hub.py), driven by the real
huggingface_hub client: exactly the manifest's files go up, a real SIGINT in the middle is resumed
by the same command without sending anything twice, and every refusal or failure is one line."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from typer.testing import CliRunner

from mla_convert import upload
from mla_convert.cli.app import app
from mla_convert.constants import MANIFEST_NAME
from mla_convert.errors import UploadError
from mla_convert.verification import verify
from support.fake_hub import WRITE_TOKEN as WRITE
from support.processes import as_from_a_terminal

REPO = "org/tiny-r1-channel-fp8"
READ = "hf_fake_read_token"
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def hub(hub):
    """conftest's, with a token that may only read (READ) too."""
    hub.add_token(READ, write=False)
    return hub


def expected_tree(out: Path) -> dict[str, str]:
    """{path: sha256} the repo must hold: the manifest's files, the manifest, and the Hub's .gitattributes."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    own = hashlib.sha256((out / MANIFEST_NAME).read_bytes()).hexdigest()
    return {rel: meta["sha256"] for rel, meta in manifest["files"].items()} | {MANIFEST_NAME: own}


def repo_tree(hub, revision: str = "main") -> dict[str, str]:
    return {p: h for p, h in hub.tree(REPO, revision).items() if p != ".gitattributes"}


def cli(*args) -> object:
    return CliRunner().invoke(app, ["upload", *map(str, args)])


def one_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def upload_commits(hub) -> list:
    return [c for c in hub.commits if c.summary != "initial commit"]


def start_upload(hub, *args, env: dict | None = None) -> subprocess.Popen:
    """The real CLI in a child process (support/upload_cli.py)."""
    child_env = {**os.environ, **hub.env(hub.hf_home), "HF_TOKEN": WRITE, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *filter(None, [child_env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "support.upload_cli", "upload", *map(str, args)]
    return subprocess.Popen(
        command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=as_from_a_terminal,  # SIGINT as at a terminal, also when this run is a background job
    )  # fmt: skip


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# --- an upload ---------------------------------------------------------------------------------------


def test_upload_sends_exactly_the_manifest_and_the_card_parses_back(hub, out, tmp_path):
    result = upload(out, REPO, create=True)
    tree = expected_tree(out)
    assert repo_tree(hub) == tree
    assert result.files == len(tree) and result.uploaded_files == len(tree) and result.skipped_files == 0
    assert result.bytes == result.uploaded_bytes == sum((out / rel).stat().st_size for rel in tree)
    assert result.created == ("repo",) and result.revision == "main"
    assert list(result.commits) == [c.sha for c in upload_commits(hub)]
    assert "structure and integrity" in result.verified and "passed" in result.verified
    # The LFS side: every shard and artifact stored once, through basic and multipart transfers.
    lfs = [p for c in upload_commits(hub) for p in c.lfs]
    assert sorted(lfs) == sorted(p for p in tree if p.endswith(".safetensors"))
    assert sorted(hub.lfs_uploads) == sorted({tree[p] for p in lfs})
    assert hub.count(kind="lfs-part") > 0 and hub.count(kind="lfs-upload") > 0
    # What makes it a model comes last, in one commit.
    last = upload_commits(hub)[-1].added
    assert set(last) == {"config.json", "model.safetensors.index.json", "mla/manifest.json", "README.md", MANIFEST_NAME}
    # The card, downloaded from the Hub, parses with its metadata.
    downloaded = Path(hf_hub_download(REPO, "README.md", cache_dir=tmp_path / "dl"))
    card = ModelCard.load(downloaded)
    meta = card.data.to_dict()
    assert "mla-convert" in meta["tags"] and "base_model" not in meta  # a local source: no base model
    # Written for the repo before the first byte went up, and recorded: the directory holds the same card.
    assert downloaded.read_bytes() == (out / "README.md").read_bytes()
    assert f"vllm serve {REPO} " in card.text and f"hf download {REPO} --local-dir" in card.text
    assert card.text.startswith("\n# tiny-r1-channel-fp8\n") and "<" + "this repo>" not in card.text
    assert result.card == f"written for {REPO}" and "--base-model" in result.base_model_hint
    assert verify(out).ok  # the directory, its card rewritten for the repo, is still what was converted
    assert (
        meta["mla_convert"]["source_fingerprint"] == json.loads((out / MANIFEST_NAME).read_text())["source_fingerprint"]
    )


def test_again_is_up_to_date_and_sends_nothing(hub, out):
    upload(out, REPO, create=True)
    commits, objects = len(hub.commits), len(hub.lfs_uploads)
    hub.reset_requests()
    result = upload(out, REPO)
    assert result.commits == () and result.uploaded_files == 0 and result.skipped_files == result.files
    assert len(hub.commits) == commits and len(hub.lfs_uploads) == objects
    assert hub.count(kind="preupload") == 0 and hub.count(method="PUT") == 0


def test_json_summary(hub, out):
    r = cli(out, REPO, "--create", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["repo"] == REPO and summary["revision"] == "main" and summary["url"].endswith(REPO)
    assert summary["commits"] == [c.sha for c in upload_commits(hub)]
    assert summary["files"] == len(expected_tree(out)) and summary["bytes"] == summary["uploaded_bytes"] > 0
    assert summary["card"] == f"written for {REPO}"
    assert f"mla-convert card {out} --base-model" in summary["base_model_hint"] and "note" not in r.stderr
    human = cli(out, REPO, "--skip-verify")  # up to date: the summary's lines carry the note
    notes = [" ".join(ln.split()) for ln in human.stdout.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: {summary['base_model_hint']}"], human.stdout


def test_dry_run_lists_files_and_bytes_and_asks_the_hub_nothing(hub, out):
    card = (out / "README.md").read_bytes()
    r = cli(out, REPO, "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["card"] == f"to be written for {REPO}" and (out / "README.md").read_bytes() == card
    summary = json.loads(r.stdout)
    plan = summary["plan"]
    assert {p["path"] for p in plan} == set(expected_tree(out))
    # Nothing was sent; what would be is said under its own name.
    assert summary["uploaded_files"] == 0 and summary["uploaded_bytes"] == 0 and summary["commits"] == []
    assert summary["would_upload_files"] == len(plan) and summary["would_upload_bytes"] == sum(p["size"] for p in plan)
    assert all(p["size"] == (out / p["path"]).stat().st_size for p in plan)
    assert plan[-1]["path"] == MANIFEST_NAME and plan[0]["path"].startswith("model-0000")
    assert hub.requests == []


def test_private_repo_on_a_new_branch(hub, out):
    result = upload(out, REPO, create=True, private=True, revision="conv-v1")
    assert hub.is_private(REPO) and result.created == ("repo", "branch")
    assert repo_tree(hub, "conv-v1") == expected_tree(out) and repo_tree(hub, "main") == {}
    assert result.url.endswith(f"{REPO}/tree/conv-v1")
    text = (out / "README.md").read_text()  # the card names the branch in its download and serve lines
    assert f"hf download {REPO} --revision conv-v1 --include 'mla/*'\nvllm serve {REPO} --revision conv-v1 " in text


def test_private_is_refused_for_an_existing_public_repo(hub, out):
    HfApi().create_repo(REPO)
    with pytest.raises(UploadError, match="exists and is public"):
        upload(out, REPO, private=True)
    assert upload_commits(hub) == []


def test_a_missing_repo_or_branch_needs_create(hub, out):
    r = cli(out, REPO)
    assert "no such model repo" in one_line(r) and "--create" in one_line(r) and r.exit_code == 2
    HfApi().create_repo(REPO)
    r = cli(out, REPO, "--revision", "v2")
    assert "no such branch" in one_line(r) and r.exit_code == 2
    assert upload_commits(hub) == []


# --- interrupted, then resumed ---------------------------------------------------------------------


@pytest.mark.slow
def test_sigint_in_the_middle_then_the_same_command_resumes_sending_nothing_twice(hub, out):
    first = expected_tree(out)["model-00001-of-00004.safetensors"]
    hub.hold_uploads(allow={first})  # its transfer goes through; the rest waits
    child = start_upload(hub, out, REPO, "--create", "--quiet")
    try:
        wait_for(lambda: first in hub.lfs_uploads and hub.puts_waiting > 0)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
        hub.release_uploads()
    assert child.returncode == 130, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines == ["error: upload interrupted before any file was committed; run the same command to upload"]
    assert repo_tree(hub) == {}  # the client's one commit of the data had not landed

    again = start_upload(hub, out, REPO, "--create", "--json")
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["uploaded_files"] == summary["files"] and len(summary["commits"]) == 2
    tree = expected_tree(out)  # the card written for the repo, by the first run already
    assert repo_tree(hub) == tree
    assert hub.lfs_uploads.count(first) == 1  # the Hub's storage held it: the client did not send it again
    assert len(hub.lfs_uploads) == len(set(hub.lfs_uploads))  # no content stored twice
    committed = [p for c in upload_commits(hub) for p in c.added]
    assert sorted(committed) == sorted(tree)  # each file in exactly one commit


def test_with_hf_xet_the_client_takes_the_xet_path_which_the_fake_hub_does_not_offer(hub, out, monkeypatch):
    """huggingface_hub 2.4 with hf_xet installed (as it requires) uploads through Xet only: its
    upload_folder asks the Hub for each file's mode, then for a Xet write token, and has no LFS
    fallback. The fake Hub has no Xet storage (no CAS server): it answers 404, which is one line
    naming the way out; HF_HUB_DISABLE_XET=1 (the other tests) takes the LFS path."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)  # as without the fake's setting
    r = cli(out, REPO, "--create")
    line = one_line(r)
    assert r.exit_code == 2 and "offers no Xet storage" in line and "HF_HUB_DISABLE_XET=1" in line
    kinds = [(q.method, q.path) for q in hub.requests if q.kind in ("preupload", "info") and "/org/" in q.path]
    assert ("POST", f"/api/models/{REPO}/preupload/main") in kinds
    assert ("GET", f"/api/models/{REPO}/xet-write-token/main") in kinds  # the Xet path, taken
    assert upload_commits(hub) == [] and hub.count(method="PUT") == 0
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    assert upload(out, REPO).commits and repo_tree(hub) == expected_tree(out)


# --- refusals, before any byte goes up ------------------------------------------------------------


@pytest.mark.parametrize("stray", ["notes.txt", ".model-00001-of-00004.safetensors.partial",
                                   ".mla-convert-journal.jsonl", ".mla-convert-source/config.json"])  # fmt: skip
def test_a_dirty_directory_is_refused_before_any_request(hub, out, stray):
    (out / stray).parent.mkdir(parents=True, exist_ok=True)
    (out / stray).write_text("not a file of the conversion")
    for extra in ([], ["--skip-verify"]):
        r = cli(out, REPO, "--create", *extra)
        line = one_line(r)
        assert r.exit_code == 2 and stray in line and "does not list" in line
    assert hub.requests == []


def test_a_changed_file_fails_the_checks_and_nothing_is_uploaded(hub, out):
    shard = out / "model-00002-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: only the sha256 tells
    shard.write_bytes(bytes(data))
    r = cli(out, REPO, "--create")
    line = one_line(r)
    assert r.exit_code == 2 and "[integrity/sha256] model-00002-of-00004.safetensors" in line
    assert hub.count(kind="create") == 0 and hub.count(method="PUT") == 0 and upload_commits(hub) == []


def test_an_unfinished_conversion_is_refused(hub, out):
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    (out / MANIFEST_NAME).write_text(json.dumps(manifest | {"status": "incomplete"}))
    assert "did not finish" in one_line(cli(out, REPO, "--create"))


def test_another_model_in_the_repo_is_refused_unless_overwrite(hub, out, tiny_src):
    hub.add_repo(REPO, tiny_src)  # the source itself: another model's files
    r = cli(out, REPO)
    line = one_line(r)
    assert r.exit_code == 2 and "holds another model" in line and "--overwrite" in line
    assert upload_commits(hub) == [] or all(c.repo_id != REPO for c in upload_commits(hub))
    foreign = sorted(set(hub.tree(REPO)) - set(expected_tree(out)))
    result = upload(out, REPO, overwrite=True)
    assert repo_tree(hub) == expected_tree(out)
    assert sorted(result.deleted) == foreign and upload_commits(hub)[-1].deleted == foreign


def test_a_card_the_hub_refuses_stops_the_upload_before_any_byte(hub, out):
    # A license the Hub does not know, as a source card may carry it: the card keeps it, the Hub refuses it.
    card = (out / "README.md").read_text().replace("license: mit", "license: MIT License")
    (out / "README.md").write_text(card)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["files"]["README.md"] = {"size": len(card.encode()), "sha256": hashlib.sha256(card.encode()).hexdigest()}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))  # the directory as converted: only the Hub objects
    with pytest.raises(UploadError, match=r"the Hub refuses this model card.s metadata .*license"):
        upload(out, REPO, create=True)
    assert hub.count(kind="create") == 0 and hub.count(method="PUT") == 0


# --- failures of the token, the Hub and the network: one line each, exit 2 ----------------------------


def test_no_token(hub, out, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    line = one_line(cli(out, REPO, "--create"))
    assert "no Hugging Face token" in line and "HF_TOKEN" in line and "hf auth login" in line


def test_an_invalid_token_is_named(hub, out, monkeypatch):
    HfApi(token=WRITE).create_repo(REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token")
    r = cli(out, REPO)
    line = one_line(r)
    assert r.exit_code == 2 and "refused the token (401" in line and "hf auth login" in line


def test_a_read_token_gets_one_line_naming_the_missing_permission(hub, out, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", READ)
    r = cli(out, REPO, "--create")
    line = one_line(r)
    assert r.exit_code == 2 and "may not create repositories in org (403" in line and "'write' role" in line

    HfApi(token=WRITE).create_repo(REPO)
    r = cli(out, REPO)
    line = one_line(r)
    assert r.exit_code == 2 and "may not write to this repo (403" in line and "write access" in line
    assert upload_commits(hub) == []


def test_a_403_from_the_hub_is_one_line_with_its_message(hub, out):
    HfApi().create_repo(REPO)
    hub.fail(REPO, status=403, method="POST", message="Your token lacks the repo.write permission", times=10)
    line = one_line(cli(out, REPO))
    assert "may not write to this repo (403: Your token lacks the repo.write permission)" in line


def test_a_full_quota_is_one_line(hub, out):
    hub.quota(1_000_000)
    line = one_line(cli(out, REPO, "--create"))
    assert "lack of storage" in line and "storage limit reached" in line and "run the same command" in line


def test_a_lost_connection_is_one_line_and_the_same_command_resumes(hub, out):
    hub.drop("commit")
    r = cli(out, REPO, "--create")
    line = one_line(r)
    assert r.exit_code == 2 and "cannot reach the Hub" in line and "run the same command again" in line
    stored = list(hub.lfs_uploads)
    assert upload(out, REPO).commits  # the same upload, again: it resumes
    assert repo_tree(hub) == expected_tree(out)
    assert hub.lfs_uploads[: len(stored)] == stored and len(hub.lfs_uploads) == len(set(hub.lfs_uploads))


def test_no_network_is_one_line(hub, out):
    endpoint = hub.endpoint
    hub.stop()  # the port is closed: connections are refused
    r = cli(out, REPO, "--create")
    line = one_line(r)
    assert r.exit_code == 2 and f"cannot reach the Hub at {endpoint}" in line


def directory_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("token", [True, False])
@pytest.mark.parametrize("hub_down", ["offline", "closed port"])
def test_a_hub_out_of_reach_is_refused_before_the_directory_is_written_with_every_problem_at_once(
    hub, out, monkeypatch, token, hub_down
):
    """The card names the repo it is written for: an upload refused before its first byte must not
    have rewritten it (nor the manifest) for a repo it never reached. No token and no Hub are two
    problems, both named in the one line."""
    before = directory_bytes(out)
    if not token:
        monkeypatch.delenv("HF_TOKEN")
    endpoint = hub.endpoint
    if hub_down == "offline":
        hub.set_offline()
    else:
        hub.stop()  # the port is closed: connections are refused
    r = cli(out, "my-org/x", "--create")
    line = one_line(r)
    assert r.exit_code == 2
    assert ("no Hugging Face token" in line) == (not token), line
    reach = "HF_HUB_OFFLINE=1 is set" if hub_down == "offline" else f"cannot reach the Hub at {endpoint}"
    assert reach in line, line
    assert directory_bytes(out) == before


def test_no_token_with_the_hub_in_reach_names_only_the_token(hub, out, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    before = directory_bytes(out)
    line = one_line(cli(out, REPO))  # no such repo either: not said, the token may be what hides it
    assert "no Hugging Face token" in line and "no such model repo" not in line and "--create" not in line
    assert directory_bytes(out) == before


@pytest.mark.slow
def test_progress_lines_in_a_log(hub, out):
    child = start_upload(hub, out, REPO, "--create", env={"MLA_CONVERT_PROGRESS_INTERVAL": "0.001"})
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    lines = stderr.splitlines()
    assert any(ln.startswith("checking: ") and "GB/s" in ln for ln in lines), stderr
    assert any(ln.startswith("uploading: ") and "GB/s" in ln for ln in lines), stderr
