"""The CLI through Typer's test runner: exit codes, one-line errors, nothing written on refusal."""

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mla_convert.cli.app import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_help_lists_commands_and_options():
    r = run("--help")
    assert r.exit_code == 0 and "deepseek-r1" in r.stdout and "demo" in r.stdout
    r = run("deepseek-r1", "--help")
    for opt in ("--out", "--format", "--target", "--workers", "--dry-run", "--json", "--quiet", "--ignore"):
        assert opt in r.stdout


def test_convert_json_summary(tiny_src, tmp_path, load_json):
    out = tmp_path / "out"
    r = run("deepseek-r1", tiny_src, "--out", out, "--format", "bf16", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["status"] == "complete" and summary["format"] == "bf16"
    assert summary["mla_layers"] == 4 and summary["shards"] == 4
    assert summary["fp8_weights_converted"] == 104
    assert load_json(out / "mla-convert-manifest.json")["status"] == "complete"


def test_dry_run_writes_nothing(tiny_src, tmp_path):
    out = tmp_path / "out"
    r = run("deepseek-r1", tiny_src, "--out", out, "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["dry_run"] is True and plan["bytes_out"] > plan["bytes_out_model"] > 0 and "disk_needed" not in plan
    assert not out.exists()


def test_non_empty_out_is_refused_and_left_alone(tiny_src, tmp_path):
    """A directory of the user's files is never an --out, with or without --overwrite."""
    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "thesis.txt").write_text("mine")
    r = run("deepseek-r1", tiny_src, "--out", out, "--quiet")
    assert r.exit_code == 2
    assert "not empty" in one_line_error(r) and "keep/thesis.txt" in r.stderr
    r = run("deepseek-r1", tiny_src, "--out", out, "--quiet", "--overwrite")
    assert r.exit_code == 2
    line = one_line_error(r)
    assert "--overwrite replaces only an earlier mla-convert output" in line and "keep/thesis.txt" in line
    assert [str(p.relative_to(out)) for p in out.rglob("*")] == ["keep", "keep/thesis.txt"]
    assert (out / "keep" / "thesis.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["same", "inside"])
def test_out_overlapping_source_is_refused(src_copy, where):
    out = src_copy if where == "same" else src_copy / "converted"
    r = run("deepseek-r1", src_copy, "--out", out, "--quiet")
    assert r.exit_code != 0 and "source" in one_line_error(r)
    assert not (src_copy / "converted").exists()


def test_non_deepseek_source_gives_one_line_error(src_copy, tmp_path, load_json):
    cfg = load_json(src_copy / "config.json")
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (src_copy / "config.json").write_text(json.dumps(cfg))
    r = run("deepseek-r1", src_copy, "--out", tmp_path / "out", "--quiet")
    assert r.exit_code == 2
    line = one_line_error(r)
    assert "LlamaForCausalLM" in line and "config.json" in line
    assert not (tmp_path / "out").exists()


def test_non_fp8_source_gives_one_line_error(src_copy, tmp_path, load_json):
    cfg = load_json(src_copy / "config.json")
    del cfg["quantization_config"]
    (src_copy / "config.json").write_text(json.dumps(cfg))
    r = run("deepseek-r1", src_copy, "--out", tmp_path / "out", "--quiet")
    assert r.exit_code == 2 and "quantization_config" in one_line_error(r)
    assert not (tmp_path / "out").exists()


def test_bad_option_values(tiny_src, tmp_path):
    r = run("deepseek-r1", tiny_src, "--out", tmp_path / "o", "--format", "int4")
    assert r.exit_code == 2 and "--format" in one_line_error(r)
    r = run("deepseek-r1", tiny_src, "--out", tmp_path / "o", "--ignore", "([")
    assert r.exit_code == 2 and "--ignore" in one_line_error(r)
    for flag in ("--kernels", "--write-io"):  # checked once, up front: also with --dry-run
        r = run("deepseek-r1", tiny_src, "--out", tmp_path / "o", flag, "fast", "--dry-run")
        assert r.exit_code == 2 and f"{flag}: " in one_line_error(r) and "'fast'" in r.stderr
    assert not (tmp_path / "o").exists()


def test_missing_source_directory(tmp_path):
    r = run("deepseek-r1", tmp_path / "nope", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "nope" in one_line_error(r)


def test_demo_runs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("demo", "--out", tmp_path / "demo", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["status"] == "complete" and summary["mla_layers"] == 4
    assert (tmp_path / "demo" / "source" / "config.json").exists()
    assert (tmp_path / "demo" / "converted-channel-fp8" / "mla" / "manifest.json").exists()


def test_commands_leave_the_cyclic_gc_on(tiny_src, tmp_path):
    """Start-up pauses the GC while torch imports; the commands must not leave it off."""
    import gc

    out = str(tmp_path / "o")
    for args in (["deepseek-r1", str(tiny_src), "--out", out, "--quiet"], ["verify", out, "--quiet"]):
        assert CliRunner().invoke(app, args).exit_code == 0
        assert gc.isenabled()


# ---- conventions: --version, choices in --help, Typer's own errors in one line -----------------


def test_version():
    from mla_convert import __version__

    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"mla-convert {__version__}"


def test_help_shows_the_choices_the_library_accepts(monkeypatch):
    from mla_convert import formats
    from mla_convert.constants import KERNEL_MODES, WRITE_MODES

    monkeypatch.setenv("COLUMNS", "200")  # no choice folded across two lines of the help's table

    text = " ".join(run("convert", "--help").stdout.split())  # the help wraps with the terminal
    for choices in (formats.names(), tuple(formats.TARGETS), KERNEL_MODES, WRITE_MODES):
        assert f"[{'|'.join(choices)}]" in text
    assert "--ignore-free-space" in text and "misreport" in text


@pytest.mark.parametrize(
    "args,expect",
    [(["--workers", "0"], "'--workers'"), (["--bogus"], "No such option: --bogus"), ([], "Missing option '--out'")],
)
def test_typers_own_errors_are_one_line(tiny_src, tmp_path, args, expect):
    out = ["--out", str(tmp_path / "o")] if expect != "Missing option '--out'" else []
    r = run("deepseek-r1", tiny_src, *out, *args)
    assert r.exit_code == 2
    line = one_line_error(r)
    assert expect in line and line.endswith("(see mla-convert deepseek-r1 --help)")
    assert not (tmp_path / "o").exists()


# ---- summaries ------------------------------------------------------------------------------------


def test_summary_of_a_bf16_conversion_shows_no_fp8_max_and_the_next_steps(tiny_src, tmp_path):
    out = tmp_path / "out"
    r = run("convert", tiny_src, "--out", out, "--format", "bf16")
    assert r.exit_code == 0, r.stderr
    assert "FP8 max" not in r.stdout and "bf16" in r.stdout
    lines = r.stdout.splitlines()
    assert f"to check it: mla-convert verify {out} --source {tiny_src}" in lines
    assert f"to serve it: vllm serve {out}" in lines
    r = run("convert", tiny_src, "--out", tmp_path / "fp8")
    assert "FP8 max 448" in r.stdout


@pytest.mark.slow
def test_summary_after_resume_says_what_was_kept(tiny_src, tmp_path, run_cli):
    from support.checkpoints import SHARD2

    out = tmp_path / "out"
    r = run_cli("convert", tiny_src, "--out", out, "--quiet", crash_at=f"after-job:{SHARD2}")
    assert r.returncode == -9
    r = run("convert", tiny_src, "--out", out, "--resume")
    assert r.exit_code == 0, r.stderr
    assert "kept 2 of 4 shard jobs (re-hashed), redid 2" in r.stdout


def test_a_device_that_differs_is_named_in_the_summary_and_warned_about(tiny_src, tmp_path, monkeypatch):
    """--device whose arithmetic differs from the CPU's (here a fake one dividing by reciprocal
    multiplication): the CPU converts, the kernels row names the CPU, the device row says why, and
    stderr carries one warning line."""
    from mla_convert.kernels import fastest
    from support import fake_device

    fastest.forget()
    monkeypatch.setitem(fastest.DEVICE_KERNEL_FACTORIES, "meta", fake_device.reciprocal_division)
    r = run("convert", tiny_src, "--out", tmp_path / "out", "--device", "meta")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    kernels = next(i for i, ln in enumerate(lines) if "│ kernels" in ln)
    device = next(i for i, ln in enumerate(lines) if "│ device" in ln)
    assert " on cpu " in lines[kernels] and device > kernels and "meta: differed" in lines[device]
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: --device meta:")]
    assert len(warnings) == 1 and "converting on the CPU instead" in warnings[0]


def test_paths_stay_whole_in_80_columns(tiny_src, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / ("a-long-output-directory-name-" * 3) / "converted-channel-fp8"
    r = run("convert", tiny_src, "--out", out)
    assert r.exit_code == 0, r.stderr
    assert max(len(ln) for ln in r.stdout.splitlines() if ln.startswith("│")) <= 80  # the table fits
    assert f"output: {out}" in r.stdout.splitlines()  # the path on one line, unbroken
    r = run("verify", out)
    assert f"checked: {out}" in r.stdout.splitlines()


@pytest.mark.slow
def test_demo_says_where_its_files_are(tmp_path):
    r = run("demo", "--out", tmp_path / "demo")
    assert r.exit_code == 0, r.stderr
    where = next(ln for ln in r.stdout.splitlines() if ln.startswith("demo files:"))
    assert str(tmp_path / "demo") in where and "MB: the tiny source and its conversion" in where
    assert f"rm -r {tmp_path / 'demo'}" in r.stdout


# ---- progress: plain lines in a log, a bar on a terminal ---------------------------------------

PROGRESS_LINE = re.compile(
    r"^converting: ([\d.]+) (GB|MB) of ([\d.]+) (GB|MB) \(([\d.]+) %\), [\d.]+ GB/s, about \S+ left$"
)


@pytest.mark.slow
def test_progress_lines_when_stderr_is_not_a_terminal(big_tensors, tmp_path, run_cli):
    src, _ = big_tensors
    # a line at every tensor's progress: how many a fixed interval gives depends on the speed
    env = {"MLA_CONVERT_PROGRESS_INTERVAL": "0.000001", "MLA_CONVERT_KERNELS": "native"}
    r = run_cli("convert", src, "--out", tmp_path / "a", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "complete"  # stdout holds the JSON only
    lines = r.stderr.splitlines()
    assert len(lines) >= 3, r.stderr
    done = []
    for line in lines:
        m = PROGRESS_LINE.match(line)
        assert m, line
        done.append(float(m[1]) * (1e9 if m[2] == "GB" else 1e6))
    assert done == sorted(done) and 0 < done[0] < done[-1]
    r = run_cli("convert", src, "--out", tmp_path / "b", "--quiet", env=env)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == ""


@pytest.mark.slow
def test_on_a_terminal_a_status_line_then_a_bar_that_reaches_100_percent(tiny_src, tmp_path):
    import os
    import pty
    import subprocess
    import sys

    parent, child = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    p = subprocess.Popen(
        [sys.executable, "-m", "mla_convert", "convert", str(tiny_src), "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=child, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert p.wait(timeout=120) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    # a status line before the bar (which of them a refresh catches follows the speed: "starting"
    # may last less than one), never the wait for torch: a conversion imports it only if it must
    assert re.search(r"(starting|reading the headers of) ", text) and "loading torch" not in text, text
    final = [ln for ln in text.replace("\r", "\n").splitlines() if ln.startswith("converting")][-1]
    assert re.search(r"9\.6/9\.6 MB", final), final


def test_help_into_a_closed_pipe_ends_quietly():
    """`mla-convert convert --help | head -1`: the reader goes away mid-help; no traceback follows."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mla_convert", "convert", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80"},
    )
    proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 1), stderr
    assert "Traceback" not in stderr, stderr


# ---- the help as a user types the command --------------------------------------------------------


def test_mla_convert_without_arguments_prints_the_help_once():
    """Before: twice (Typer's rich help printed itself while the error was built, then again)."""
    r = subprocess.run([sys.executable, "-m", "mla_convert"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Usage: mla-convert") == 1 and "Commands:" in r.stdout


@pytest.mark.parametrize("command", ["convert", "deepseek-r1", "verify", "demo"])
def test_help_shows_options_as_typed_and_cuts_nothing_at_80_columns(monkeypatch, command):
    """Before: `<bool>`, `<list[str]>`, `{source}`, and the --ignore example ended in an ellipsis."""
    monkeypatch.setenv("COLUMNS", "80")
    text = run(command, "--help").stdout
    assert not re.search(r"<(bool|str|path|int|list\[str\]|int range)>", text), text
    assert "{" not in text.split("\n", 2)[0] and "…" not in text
    assert max(map(len, text.splitlines())) <= 80
    if command in ("convert", "deepseek-r1"):
        usage = "[OPTIONS] SOURCE" if command == "convert" else "[OPTIONS] [SOURCE]"
        assert f"Usage: mla-convert {command} {usage}" in text
        for typed in ("-o, --out DIR", "--ignore REGEX", "-w, --workers N", "--revision REV", "--device DEVICE"):
            assert typed in text
        assert any(ln.strip() == r"'model\.layers\.\d+\.mlp\.experts\.'" for ln in text.splitlines()), text
    if command == "demo":
        assert "deepseek-r1" in text


def test_the_commands_list_shows_each_command_whole_in_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    commands = run("--help").stdout.split("Commands:")[1]
    assert "..." not in commands and all(f"  {c} " in commands for c in ("convert", "deepseek-r1", "demo", "verify"))


def test_target_gaudi2_with_bf16_is_refused_before_anything_is_written(tiny_src, tmp_path):
    """Before: accepted silently, gaudi3's bytes written and gaudi2 recorded. A bf16 output is the
    same for every target, so only the default is taken (a recorded one of an earlier version
    still verifies)."""
    out = tmp_path / "out"
    r = run("convert", tiny_src, "--out", out, "--format", "bf16", "--target", "gaudi2")
    assert r.exit_code == 2
    assert "--target gaudi2: a bf16 output has no FP8 range" in one_line_error(r)
    assert not out.exists()
    r = run("convert", tiny_src, "--out", out, "--format", "bf16", "--target", "gaudi3", "--quiet")
    assert r.exit_code == 0, r.stderr


def test_an_earlier_bf16_output_recorded_for_gaudi2_still_verifies(converted, tmp_path):
    import shutil

    out = shutil.copytree(converted["bf16"], tmp_path / "out")
    manifest = out / "mla-convert-manifest.json"
    manifest.write_text(manifest.read_text().replace('"target": "gaudi3"', '"target": "gaudi2"'))
    doc = json.loads(manifest.read_text())
    assert doc["options"]["target"] == "gaudi2"
    r = run("verify", out, "--json")
    assert json.loads(r.stdout)["groups"]["structure"]["failed"] == 0


def test_verify_of_a_bf16_output_prints_no_fp8_readers_line(converted):
    r = run("verify", converted["bf16"])
    assert r.exit_code == 0 and "fp8 readers" not in r.stdout and "value readers: " in r.stdout


@pytest.mark.slow
def test_demo_takes_deepseek_r1_as_the_readme_calls_it(tmp_path):
    """Before: `--family deepseek-r1` was refused, though the README calls the demo R1-shaped."""
    r = run("demo", "--family", "deepseek-r1", "--out", tmp_path / "demo", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["verify"]["ok"] is True
    r = run("demo", "--family", "deepseek-r2", "--out", tmp_path / "other")
    assert r.exit_code == 2 and "expected one of deepseek-r1, deepseek-v3" in one_line_error(r)


def test_a_failure_of_the_environment_says_what_next_only_in_the_middle_of_a_run(tmp_path):
    """A full disk mid-run says what to do next (--resume); before, 'write failed: No space left on
    device' said nothing of it."""
    import errno

    from mla_convert.cli.convert_cmd import next_step
    from mla_convert.errors import OutputError

    def failure(code):
        try:
            try:
                raise OSError(code, os.strerror(code))
            except OSError as e:
                raise OutputError("x.safetensors: write failed") from e
        except OutputError as e:
            return e

    out = tmp_path / "out"
    assert next_step(out, failure(errno.ENOSPC)) is None  # nothing written yet: the error says its own fix
    out.mkdir()
    (out / "mla-convert-manifest.json").write_text('{"status": "incomplete"}')
    assert next_step(out, failure(errno.ENOSPC)).startswith("free some space on that filesystem, then finish it")
    assert "ulimit -f" in next_step(out, failure(errno.EFBIG))
    assert next_step(out, OutputError("not the environment's")) is None
    (out / "mla-convert-manifest.json").write_text('{"status": "complete"}')
    assert next_step(out, failure(errno.ENOSPC)) is None


# The modules behind mla_convert.convert / verify / upload / card / demo: a command reaches them
# through mla_convert.api only, so the CLI and the library run one path.
RUN_MODULES = {
    "mla_convert.conversion.pipeline", "mla_convert.verification.api", "mla_convert.publish.upload",
    "mla_convert.demo.run", "mla_convert.output.card", "mla_convert.output.lock",
}  # fmt: skip


def test_every_command_runs_through_the_api():
    import ast
    from pathlib import Path

    cli = Path(__file__).resolve().parent.parent / "mla_convert" / "cli"
    reached, uses_api = {}, set()
    for path in cli.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "mla_convert" and any(a.name == "api" for a in node.names):
                    uses_api.add(path.name)
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name in RUN_MODULES:
                    reached.setdefault(path.name, []).append(name)
    assert reached == {}
    assert {"convert_cmd.py", "verify_cmd.py", "upload_cmd.py", "card_cmd.py", "demo_cmd.py"} <= uses_api


def test_the_console_prints_the_typed_results(tiny_src, tmp_path, capsys):
    """The summary and the report are printed from ConversionResult / VerifyReport: their fields,
    not a dict's keys (a dict is refused)."""
    import mla_convert
    from mla_convert.cli import console

    result = mla_convert.convert(tiny_src, tmp_path / "out", format="bf16")
    console.print_summary(result, "Converted", str(tiny_src))
    report = mla_convert.verify(result.out, source=tiny_src)
    console.print_verify_report(report, quiet=False)
    out = capsys.readouterr().out
    assert f"mla-convert verify {tmp_path / 'out'} --source {tiny_src}" in out
    assert "MLA layers (W_UK_T / W_UV)" in out and "PASS" in out and f"checked: {tmp_path / 'out'}" in out
    with pytest.raises(AttributeError):
        console.print_summary(result.to_json(), "Converted")
