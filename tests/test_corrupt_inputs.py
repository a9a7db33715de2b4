"""A damaged file is a clear line, never an internal error: any byte of any file
that a command or the plugin reads (the configs, the index, the conversion manifest, the MLA
manifest, the model card, safetensors headers, the demo marker, the lock, the kernel verdicts)
changed, cut short, made non-UTF-8 or given JSON of the wrong type: `verify` fails naming the file
(exit 1) or refuses in one line (exit 2), the other commands refuse in one line, the plugin refuses
with an ArtifactError naming the file. Exit code 70 (a bug) never.

The named cases first, each one found by the mutation tests at the end (a fixed number of
derandomized examples in the default group; more in the `slow` one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mla_convert.cli.app import app
from mla_runtime import ArtifactError, open_artifacts
from mla_runtime.format import read_manifest
from support.checkpoints import SHARD1, SHARD2

MLA_MANIFEST = "mla/manifest.json"
runner = CliRunner()


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def _cli(*args) -> tuple[int, list[str]]:
    """(exit code, stderr's non-empty lines) of the CLI run in this process."""
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, [ln for ln in res.stderr.splitlines() if ln.strip()]


def _put_byte(path: Path, at: int, byte: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] = byte
    path.write_bytes(bytes(data))


# ---- the MLA manifest: verify and the plugin read the same file ----------------------------------


def test_a_non_utf8_byte_in_the_mla_manifest_fails_verify_naming_it_and_the_plugin_refuses(converted, tmp_path):
    out = _copy(converted["bf16"], tmp_path)
    _put_byte(out / MLA_MANIFEST, 10, 0xFF)
    code, lines = _cli("verify", out)
    assert code == 1, lines
    assert any(MLA_MANIFEST in ln and "UTF-8" in ln for ln in lines), lines
    with pytest.raises(ArtifactError, match=rf"^{out / MLA_MANIFEST}: .*UTF-8"):
        open_artifacts(out / "mla", model_dir=out)


def _layer0(d):
    return d["layers"][0]


MLA_MANIFEST_EDITS = {
    "a list for the manifest": (lambda d: [d], "a JSON object"),
    "producer a list": (lambda d: d.update(producer=[1, 2]), "producer"),
    "producer a string": (lambda d: d.update(producer="x"), "producer"),
    "dims a list": (lambda d: d.update(dims=[8, 128]), "dims"),
    "a dim a string": (lambda d: d["dims"].update(num_heads="8"), "dims.num_heads"),
    "a dim a float": (lambda d: d["dims"].update(kv_lora_rank=512.5), "dims.kv_lora_rank"),
    "a dim a bool": (lambda d: d["dims"].update(v_head_dim=True), "dims.v_head_dim"),
    "a dim negative": (lambda d: d["dims"].update(qk_nope_head_dim=-128), "dims.qk_nope_head_dim"),
    "a dim null": (lambda d: d["dims"].update(num_heads=None), "dims.num_heads"),
    "a dim missing": (
        lambda d: d.update(dims={k: v for k, v in d["dims"].items() if k != "num_heads"}),
        "dims.num_heads",
    ),
    "a dim unknown": (lambda d: d["dims"].update(rope=64), "dims.rope"),
    "layers an object": (lambda d: d.update(layers={"0": 1}), "layers"),
    "a layer a list": (lambda d: d["layers"].__setitem__(0, [0]), "layers[0]"),
    "a layer index a string": (lambda d: _layer0(d).update(layer="0"), "layers[0].layer"),
    "a layer index negative": (lambda d: _layer0(d).update(layer=-1), "layers[0].layer"),
    "a size a float": (lambda d: _layer0(d).update(size=1.5), "layers[0].size"),
    "a size negative": (lambda d: _layer0(d).update(size=-1), "layers[0].size"),
    "a sha256 an object": (lambda d: _layer0(d).update(sha256={"a": 1}), "layers[0].sha256"),
    "a file a number": (lambda d: _layer0(d).update(file=3), "layers[0].file"),
    "a layer's dims a list": (lambda d: _layer0(d).update(dims=[1]), "layers[0].dims"),
    "a layer's dim a string": (lambda d: _layer0(d).update(dims={"qk_nope_head_dim": "x"}), "layers[0].dims"),
    "the fingerprint a number": (lambda d: d.update(source_fingerprint=5), "source_fingerprint"),
    "format_version true": (lambda d: d.update(format_version=True), "format_version"),
}


@pytest.mark.parametrize("case", MLA_MANIFEST_EDITS)
def test_an_mla_manifest_field_of_the_wrong_type_is_refused_naming_the_file_and_the_field(converted, tmp_path, case):
    out = _copy(converted["bf16"], tmp_path)
    edit, field = MLA_MANIFEST_EDITS[case]
    path = out / MLA_MANIFEST
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as e:
        read_manifest(out / "mla")
    line = str(e.value)
    assert line.startswith(f"{path}: ") and field in line and "\n" not in line, line
    code, lines = _cli("verify", out)
    assert code == 1 and any(MLA_MANIFEST in ln and field in ln for ln in lines), lines


@pytest.mark.parametrize("document", [[1, 2], "x", 1.5, None])
def test_an_output_config_that_is_not_an_object_fails_verify_against_its_source_naming_it(
    converted, tiny_src, tmp_path, document
):
    """verify --source exited 70 (integrity.check_source_identity iterated the config)."""
    out = _copy(converted["channel-fp8"], tmp_path)
    (out / "config.json").write_text(json.dumps(document))
    code, lines = _cli("verify", out, "--source", tiny_src)
    assert code == 1 and any("config.json" in ln and "JSON object" in ln for ln in lines), lines


# ---- the served model's config, as the plugin reads it --------------------------------------------


CONFIG_EDITS = {
    "a list": (lambda c: [c], "a JSON object"),
    "heads a string": (lambda c: c.update(num_attention_heads="8"), "num_attention_heads"),
    "heads a bool": (lambda c: c.update(num_attention_heads=True), "num_attention_heads"),
    "heads null": (lambda c: c.update(num_attention_heads=None), "num_attention_heads"),
    "kv_lora_rank a float": (lambda c: c.update(kv_lora_rank=512.0), "kv_lora_rank"),
    "layers a list": (lambda c: c.update(num_hidden_layers=[3]), "num_hidden_layers"),
    "layers negative": (lambda c: c.update(num_hidden_layers=-3), "num_hidden_layers"),
    "nope flags a string": (lambda c: c.update(nope_layer_flags="yes"), "nope_layer_flags"),
    "kv sources an object": (lambda c: c.update(kv_source_layers={"a": 1}), "kv_source_layers"),
}


@pytest.mark.parametrize("case", CONFIG_EDITS)
def test_a_served_config_of_the_wrong_type_is_refused_by_the_plugin_naming_the_file(converted, tmp_path, case):
    out = _copy(converted["bf16"], tmp_path)
    edit, field = CONFIG_EDITS[case]
    path = out / "config.json"
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError) as e:
        open_artifacts(out / "mla", model_dir=out)
    line = str(e.value)
    assert line.startswith(f"{path}: ") and field in line and "\n" not in line, line


def test_a_non_utf8_served_config_is_refused_by_the_plugin_naming_it(converted, tmp_path):
    out = _copy(converted["bf16"], tmp_path)
    _put_byte(out / "config.json", 5, 0xFE)
    with pytest.raises(ArtifactError, match=rf"^{out / 'config.json'}: .*UTF-8"):
        open_artifacts(out / "mla", model_dir=out)


@pytest.mark.parametrize(
    "edit",
    [lambda m: [m], lambda m: m.update(status=["complete"]), lambda m: m.update(source_fingerprint=5)],
    ids=["a list", "status a list", "fingerprint a number"],
)
def test_a_conversion_manifest_of_the_wrong_type_is_refused_by_the_plugin_naming_it(converted, tmp_path, edit):
    out = _copy(converted["bf16"], tmp_path)
    path = out / "mla-convert-manifest.json"
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=rf"^{path}: "):
        open_artifacts(out / "mla", model_dir=out)


def test_a_non_utf8_conversion_manifest_is_refused_by_the_plugin_naming_it(converted, tmp_path):
    out = _copy(converted["bf16"], tmp_path)
    _put_byte(out / "mla-convert-manifest.json", 3, 0xC3)
    with pytest.raises(ArtifactError, match=rf"^{out / 'mla-convert-manifest.json'}: "):
        open_artifacts(out / "mla", model_dir=out)


# ---- the conversion manifest: verify, card, upload and --resume read it ------------------------------

CONVERSION_MANIFEST_EDITS = {
    "a file's entry a string": (lambda m: m["files"].update({"README.md": "x"}), "files['README.md']"),
    "a file's sha256 a number": (lambda m: m["files"]["config.json"].update(sha256=5), "files['config.json']"),
    "a file's size negative": (lambda m: m["files"]["config.json"].update(size=-1), "files['config.json']"),
    "options a float": (lambda m: m.update(options=1.5), "options"),
    "options.format a list": (lambda m: m["options"].update(format=["bf16"]), "options.format"),
    "the card record a list": (lambda m: m.update(card=[1, 2]), "card"),
    "status a list": (lambda m: m.update(status=["complete"]), "status"),
    "source a string": (lambda m: m.update(source="x"), "source"),
}


@pytest.mark.parametrize("case", CONVERSION_MANIFEST_EDITS)
def test_a_conversion_manifest_entry_of_the_wrong_type_is_one_line_naming_it(converted, tmp_path, offline, case):
    """verify exited 70 (AttributeError in integrity._check_listed_files), card too (output.card),
    upload --dry-run too (publish.upload._card_state)."""
    out = _copy(converted["channel-fp8"], tmp_path)
    edit, entry = CONVERSION_MANIFEST_EDITS[case]
    path = out / "mla-convert-manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    for args in (["verify", out], ["card", out], ["upload", out, "me/x", "--dry-run"]):
        code, lines = _cli(*args)
        assert code == 2 and len(lines) == 1, (args, lines)
        assert lines[0].startswith(f"error: {path}: ") and entry in lines[0], (args, lines)


@pytest.mark.parametrize(("field", "value"), [("heads", 1.5), ("fp8_max", "x"), ("repo_id", 5), ("mla_bytes", None)])
def test_a_card_record_of_the_wrong_type_is_refused_by_card_naming_the_manifest(converted, tmp_path, field, value):
    """`card` exited 70 (a TypeError or StopIteration writing the card's text from the record)."""
    out = _copy(converted["channel-fp8"], tmp_path)
    path = out / "mla-convert-manifest.json"
    doc = json.loads(path.read_text())
    doc["card"][field] = value
    path.write_text(json.dumps(doc))
    code, lines = _cli("card", out)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {path}: "), lines


def test_a_card_whose_front_matter_is_not_yaml_is_written_again(converted, tmp_path):
    """8 bytes cut out of README.md's front matter (found by the mutation test): `card` exited 70 on
    the YAML ScannerError, in several lines."""
    out = _copy(converted["channel-fp8"], tmp_path)
    data = (out / "README.md").read_bytes()
    (out / "README.md").write_bytes(data[:9] + data[17:])
    code, lines = _cli("card", out)
    assert code in (0, 2) and not any(ln.startswith("error: unexpected ") for ln in lines), lines


def test_a_damaged_manifest_of_an_unfinished_conversion_refuses_resume_naming_it(tiny_src, unfinished, tmp_path):
    out = _copy(unfinished, tmp_path)
    path = out / "mla-convert-manifest.json"
    doc = json.loads(path.read_text())
    doc["files"] = {"x": [1]}
    path.write_text(json.dumps(doc))
    code, lines = _cli("convert", tiny_src, "--out", out, "--resume")
    errors = [ln for ln in lines if ln.startswith("error: ")]  # after the notice of the killed run's lock taken over
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {path}: ") and "files['x']" in errors[0]


def test_a_damaged_ref_in_the_hub_cache_is_no_snapshot(tmp_path, monkeypatch):
    """The plugin, served by Hub id, reads refs/main of the Hub cache: a non-UTF-8 byte there raised
    UnicodeDecodeError out of mla_runtime.hub_cache.snapshot_of (vLLM's start failed with a traceback)."""
    from mla_runtime import hub_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "refs" / "main").write_bytes(b"a" * 40)
    assert hub_cache.snapshot_of("acme/model") is not None
    (repo / "refs" / "main").write_bytes(b"a" * 39 + b"\xff")
    assert hub_cache.snapshot_of("acme/model") is None


# ---- the kernel verdicts under the cache: a damaged record is no record --------------------------------


@pytest.fixture
def verdict_cache(monkeypatch, tmp_path):
    """A private native cache holding this host's built library, with no verdicts remembered."""
    from mla_convert.kernels import fastest, native, verdict

    built = native.build()
    private = tmp_path / "native-cache"
    private.mkdir()
    shutil.copy2(built, private / built.name)
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(private))
    for forget in (native.reset, verdict.forget, fastest.forget):
        forget()
    yield private
    for forget in (native.reset, verdict.forget, fastest.forget):
        forget()


@pytest.mark.parametrize(
    "damage",
    [lambda b: {**b, "ops": [1, 2]}, lambda b: {**b, "ops": "fp8"}, lambda b: {**b, "torch": ["x"]}, b"\xff{"],
    ids=["ops of numbers", "ops a string", "torch a list", "not UTF-8"],
)
def test_a_damaged_kernel_verdict_means_checking_again(verdict_cache, damage):
    """A record whose ops were not a list of names made every conversion exit 70 (kernels.verdict.lookup)."""
    from mla_convert.kernels import modes
    from mla_convert.kernels.fastest import select_kernels

    block, ops = (128, 128), ("fp8",)
    assert select_kernels(block, 448.0, "cpu", ("native", "eager"), ops).name == "native"
    (record,) = sorted((verdict_cache / "verdicts").glob("*.json"))
    body = json.loads(record.read_text())
    record.write_bytes(damage if isinstance(damage, bytes) else json.dumps(damage(body)).encode())
    assert modes.cached_native(block, 448.0, True, ops) is None


# ---- mutation tests: any byte of any file read ------------------------------------------------------

# The files each command reads, by where they are: the finished output, its source, an unfinished
# output (a conversion killed after its second shard: what --resume reads).
OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "mla-convert-manifest.json",
                "README.md", MLA_MANIFEST, SHARD1, "mla/layer-001.safetensors", "tokenizer_config.json")  # fmt: skip
SOURCE_FILES = ("config.json", "model.safetensors.index.json", SHARD2, "generation_config.json")
UNFINISHED_FILES = (".mla-convert-journal.jsonl", "mla-convert-manifest.json", SHARD1, SHARD2)
WRONG_TYPES = ([1, 2], "x", 1.5, True, None, -3, {}, {"a": 1}, "", 10**30)

mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(0, 7)),
    st.tuples(st.just("delete"), st.integers(0, 2**20), st.integers(1, 8)),
    st.tuples(st.just("insert"), st.integers(0, 2**20), st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20)),
    st.tuples(st.just("not utf-8"), st.integers(0, 2**20), st.sampled_from([0xFF, 0xC3, 0x80, 0xFE])),
    st.tuples(st.just("retype"), st.integers(0, 2**20), st.sampled_from(WRONG_TYPES)),
)


def _retyped(doc, pick: int, value):
    """`doc` with its pick-th node (in walk order, the root first) replaced by `value`."""
    nodes = []

    def walk(node, path):
        nodes.append(path)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items)[:8]:
            walk(v, (*path, k))

    walk(doc, ())
    path = nodes[pick % len(nodes)]
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


def _mutate(path: Path, mutation) -> None:
    """One mutation of the file at `path`; a safetensors file's within its header (its data is
    covered by the sha256 checks), keeping the header's length where a retyped header fits."""
    data = path.read_bytes()
    kind, at, *arg = mutation
    header_end = 8 + int.from_bytes(data[:8], "little") if path.suffix == ".safetensors" else len(data)
    if kind == "retype":
        try:
            body = data[8:header_end] if path.suffix == ".safetensors" else data
            new = json.dumps(_retyped(json.loads(body), at, arg[0])).encode()
        except ValueError:  # not JSON (the card, a JSON-lines journal): a byte instead
            kind, arg = "not utf-8", [0xFF]
        else:
            if path.suffix == ".safetensors":
                new = len(new).to_bytes(8, "little") + new + data[header_end:]
            path.write_bytes(new)
            return
    at %= max(header_end, 1)
    b = bytearray(data)
    if kind == "flip":
        b[at] ^= 1 << arg[0]
    elif kind == "delete":
        del b[at : at + arg[0]]
    elif kind == "insert":
        b[at:at] = arg[0]
    elif kind == "truncate":
        del b[at:]
    else:
        b[at] = arg[0]
    path.write_bytes(bytes(b))


def _no_internal_error(args) -> tuple[int, str]:
    code, lines = _cli(*args)
    assert code != 70 and not any(ln.startswith("error: unexpected ") for ln in lines), (args, lines)  # a bug's line
    assert code in (0, 1, 2), (args, code, lines)
    if code == 2:  # one error line (a notice may come first: a killed run's lock taken over)
        assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, (args, lines)
    return code, "\n".join(lines)


def _plugin_opens_or_refuses(out: Path) -> None:
    """The plugin's reading of a served directory: the artifacts open and every layer loads, or an
    ArtifactError (a refusal naming what is wrong); nothing else."""
    try:
        arts = open_artifacts(out / "mla", model_dir=out)
        for layer in arts.layers:
            arts.load_layer(layer)
    except ArtifactError as e:
        assert "\n" not in str(e), str(e)


@pytest.fixture(scope="module")
def unfinished(tiny_src, tmp_path_factory, run_cli) -> Path:
    """An output whose conversion was killed (SIGKILL) after its second shard: --resume finishes it."""
    out = tmp_path_factory.mktemp("unfinished") / "out"
    r = run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at=f"after-job:{SHARD2}")
    assert r.returncode == -9, r.stderr
    return out


def _check_one_mutation(tmp: Path, converted, tiny_src, unfinished, where: str, rel: str, mutation) -> None:
    base = tmp / f"case-{len(list(tmp.iterdir()))}"
    if where == "source":
        src = Path(shutil.copytree(tiny_src, base / "src"))
        _mutate(src / rel, mutation)
        _no_internal_error(["verify", converted["channel-fp8"], "--source", src])
        _no_internal_error(["convert", src, "--out", base / "new", "--dry-run"])
    elif where == "unfinished":
        out = Path(shutil.copytree(unfinished, base / "out"))
        _mutate(out / rel, mutation)
        _no_internal_error(["convert", tiny_src, "--out", out, "--resume", "--quiet"])
    else:
        out = Path(shutil.copytree(converted["channel-fp8"], base / "out"))
        _mutate(out / rel, mutation)
        _plugin_opens_or_refuses(out)
        code, said = _no_internal_error(["verify", out])
        # every file but the conversion manifest is hashed into it (a change there may be whitespace)
        assert code != 0 or rel == "mla-convert-manifest.json", said
        _no_internal_error(["upload", out, "me/mutated", "--dry-run"])
        _no_internal_error(["card", out])
    shutil.rmtree(base)


FILES = (
    [("output", f) for f in OUTPUT_FILES]
    + [("source", f) for f in SOURCE_FILES]
    + [("unfinished", f) for f in UNFINISHED_FILES]
)
files = st.sampled_from(FILES)


@pytest.fixture
def offline(monkeypatch):
    """No Hub: `upload --dry-run` reads the directory and asks nothing."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@settings(max_examples=10, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(file=files, mutation=mutations)
def test_a_mutated_file_is_never_an_internal_error(converted, tiny_src, unfinished, tmp_path, offline, file, mutation):
    _check_one_mutation(tmp_path, converted, tiny_src, unfinished, *file, mutation)


@pytest.mark.slow
@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(file=files, mutation=mutations)
def test_many_mutated_files_are_never_an_internal_error(converted, tiny_src, unfinished, tmp_path, offline, file,
                                                        mutation):  # fmt: skip
    _check_one_mutation(tmp_path, converted, tiny_src, unfinished, *file, mutation)


@pytest.mark.parametrize(("where", "rel"), FILES, ids=[f"{w}:{f}" for w, f in FILES])
@pytest.mark.parametrize(
    "mutation",
    [("not utf-8", 7, 0xFF), pytest.param(("truncate", 40), marks=pytest.mark.slow), ("retype", 0, [1, 2])],
    ids=["a non-UTF-8 byte", "cut short", "a list for the document"],
)
def test_each_file_read_damaged_in_each_way_is_never_an_internal_error(converted, tiny_src, unfinished, tmp_path,
                                                                       offline, where, rel, mutation):  # fmt: skip
    _check_one_mutation(tmp_path, converted, tiny_src, unfinished, where, rel, mutation)
