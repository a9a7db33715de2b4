"""The public API, used as a library user would: only `import mla_convert` and what it exports
(docs/api.md)."""

import json
import subprocess
import sys

import pytest

import mla_convert


def test_importing_the_package_imports_no_torch():
    code = "import sys, mla_convert; mla_convert.Options(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_convert_then_verify_with_typed_results(tiny_src, tmp_path):
    result = mla_convert.convert(tiny_src, tmp_path / "out", target="gaudi2", ignore=[r"model\.layers\.0\.mlp\."])
    assert isinstance(result, mla_convert.ConversionResult)
    assert (result.status, result.format, result.target, result.fp8_max) == ("complete", "channel-fp8", "gaudi2", 240.0)
    assert result.mla_layers == 4 and result.out == str(tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "mla-convert-manifest.json").read_text())
    assert manifest["options"] == {
        "format": "channel-fp8", "target": "gaudi2", "ignore": [r"model\.layers\.0\.mlp\."], "card": True
    }  # fmt: skip
    report = mla_convert.verify(result.out, source=tiny_src)
    assert isinstance(report, mla_convert.VerifyReport)
    assert report.ok and report.exit_code == 0 and report.failures() == []
    assert report.groups["source"].checked > 0 and report.groups["mla"].failed == 0
    assert report.to_json()["groups"]["mla"]["checked"] == report.groups["mla"].checked


def test_to_json_is_what_the_cli_prints(tiny_src, tmp_path, run_cli):
    """The library's result and the CLI's --json are one thing: the same keys and values (but for
    the time taken and the free space, which change from run to run)."""
    result = mla_convert.convert(tiny_src, tmp_path / "lib", dry_run=True)
    cli = json.loads(run_cli("convert", tiny_src, "--out", tmp_path / "lib", "--dry-run", "--json").stdout)
    ours = result.to_json()
    assert list(cli) == list(ours)
    assert {k: v for k, v in cli.items() if k != "disk_free"} == {k: v for k, v in ours.items() if k != "disk_free"}


def test_a_failed_check_is_a_typed_failure(tiny_src, tmp_path):
    out = tmp_path / "out"
    mla_convert.convert(tiny_src, out, format="bf16")
    side = out / "generation_config.json"
    side.write_text(side.read_text().replace("0.6", "0.7"))  # a side file changed after the conversion
    report = mla_convert.verify(out)
    assert not report.ok and report.exit_code == 1
    (failure,) = report.failures()
    assert isinstance(failure, mla_convert.Failure)
    assert (failure.group, failure.check, failure.file) == ("integrity", "sha256", "generation_config.json")
    assert failure.line().startswith("[integrity/sha256] generation_config.json: expected ")


def test_settings_and_options_objects_or_fields(tiny_src, tmp_path):
    """Options / RunSettings objects, fields by name, or both (the fields win); an unknown name
    is a TypeError, as for any function, and nothing is written."""
    opts, settings = mla_convert.Options(format="bf16"), mla_convert.RunSettings(workers=2, dry_run=True)
    a = mla_convert.convert(tiny_src, tmp_path / "a", options=opts, settings=settings)
    b = mla_convert.convert(tiny_src, tmp_path / "b", format="bf16", workers=2, dry_run=True)
    c = mla_convert.convert(
        tiny_src, tmp_path / "c", options=opts, settings=settings, format="channel-fp8", target="gaudi2"
    )
    assert (a.format, a.workers, a.dry_run) == (b.format, b.workers, b.dry_run) == ("bf16", 2, True)
    assert (c.format, c.target) == ("channel-fp8", "gaudi2") and a.target == "gaudi3"
    with pytest.raises(mla_convert.ConvertError, match="a bf16 output has no FP8 range"):  # issue 26
        mla_convert.convert(tiny_src, tmp_path / "d", options=opts, settings=settings, target="gaudi2")
    with pytest.raises(TypeError, match="worker"):
        mla_convert.convert(tiny_src, tmp_path / "d", worker=2)
    assert not any((tmp_path / d).exists() for d in "abcd")


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda src, out: mla_convert.convert(src / "nope", out), mla_convert.SourceError, "no such directory"),
        (lambda src, out: mla_convert.convert(src, out, format="fp4"), mla_convert.ConvertError, "format='fp4'"),
        (lambda src, out: mla_convert.convert(src, out, ignore="x"), mla_convert.ConvertError, "sequence"),
        (lambda src, out: mla_convert.verify(out), mla_convert.VerificationError, "no such directory"),
    ],
)
def test_errors_are_the_exported_types(tiny_src, tmp_path, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny_src, tmp_path / "out")
