"""The public API, used as a library user would: only `import mla_convert` and what it exports
(docs/api.md)."""

import json
import subprocess
import sys
from pathlib import Path

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
    with pytest.raises(mla_convert.ConvertError, match="a bf16 output has no FP8 range"):  # bf16 takes no target
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


def _first_example() -> str:
    """docs/api.md's first Python block, as it stands there."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def _run_script(tmp_path, code: str) -> subprocess.CompletedProcess:
    """`code` as a file, run as a plain script (`python script.py`, no `if __name__ == "__main__":`
    guard), in a directory of its own."""
    script = tmp_path / "api_try.py"
    script.write_text(code)
    return subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_the_documented_example_runs_as_a_plain_script_with_two_workers(tiny_src, tmp_path):
    """docs/api.md's first example pasted into a script, unguarded. Before: each spawned worker ran
    the script again, met the output lock, and the parent reported a worker killed by the
    out-of-memory killer."""
    example = _first_example()
    assert "workers=2" in example and "__main__" not in example
    code = example.replace("/data/DeepSeek-R1", str(tiny_src)).replace("/data/R1-channel-fp8", str(tmp_path / "out"))
    assert code.count(str(tiny_src)) == 2  # the source in both calls: nothing else was changed
    r = _run_script(tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("complete 4 ") and r.stdout.rstrip().endswith("GB/s"), r.stdout
    assert mla_convert.verify(tmp_path / "out", source=tiny_src).ok


def test_verify_with_two_workers_runs_as_a_plain_script(converted, tmp_path):
    code = (
        "import mla_convert\n"
        f"report = mla_convert.verify({str(converted['channel-fp8'])!r}, workers=2)\n"
        "print(report.ok, report.groups['integrity'].checked)\n"
    )
    r = _run_script(tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True "), r.stdout


def test_where_workers_must_run_the_script_again_an_unguarded_call_is_refused_before_any_work(tiny_src, tmp_path):
    """Where spawn cannot leave the main module out (process.workers._SpawnPopen is None: another
    Python's multiprocessing), an unguarded call with workers is one line saying what to add, and
    nothing is written; the same call under the guard runs."""
    as_elsewhere = "from mla_convert.process import workers\nworkers._SpawnPopen = None\nimport mla_convert\n"
    call = f"mla_convert.convert({str(tiny_src)!r}, {str(tmp_path / 'out')!r}, workers=2)\n"
    r = _run_script(tmp_path, as_elsewhere + call)
    assert r.returncode == 1 and not (tmp_path / "out").exists(), r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == (
        f"mla_convert.errors.ConvertError: {tmp_path / 'api_try.py'} calls mla_convert with more than one worker "
        'from its top level, and each worker process would run it again: put the call under `if __name__ == "__main__":`'
    )
    r = _run_script(tmp_path, as_elsewhere + 'if __name__ == "__main__":\n    ' + call)
    assert r.returncode == 0, r.stderr
    assert mla_convert.verify(tmp_path / "out", source=tiny_src).ok
