"""An option refused through the library speaks the library's terms (`target='gaudi2'`, not
`--target gaudi2`); the command line still names its flags."""

from __future__ import annotations

import pytest

import mla_convert
from mla_convert.settings import Options, RunSettings
from support.cli_runner import cli_error

CASES = [
    (lambda src, out: mla_convert.convert(src, out, format="fp4"), "format='fp4': expected one of"),
    (lambda src, out: mla_convert.convert(src, out, target="gaudi5"), "target='gaudi5': expected one of"),
    (
        lambda src, out: mla_convert.convert(src, out, format="bf16", target="gaudi2", dry_run=True),
        "target='gaudi2': a bf16 output has no FP8 range and is the same for every target; leave target out "
        "(it applies to format='channel-fp8')",
    ),
    (lambda src, out: mla_convert.convert(src, out, ignore=("x(",)), "ignore pattern 'x(': not a valid regular"),
    (
        lambda src, out: mla_convert.convert(src, out, ignore=("nomatch",), dry_run=True),
        "ignore pattern 'nomatch' matches none of the 104 linears",
    ),
    (lambda src, out: mla_convert.convert(src, out, base_model="./here"), "base_model='./here': expected a Hub"),
    (lambda src, out: RunSettings(write_io="fast"), "write_io='fast': unknown mode"),
    (lambda src, out: RunSettings(kernels="fast"), "kernels='fast': expected one of"),
    (lambda src, out: mla_convert.convert(src, out, device="nosuch", dry_run=True), "device='nosuch' is not usable"),
]


@pytest.mark.parametrize(("call", "message"), CASES)
def test_library_errors_name_the_librarys_keywords(tiny_src, tmp_path, call, message):
    with pytest.raises(mla_convert.ConvertError) as e:
        call(tiny_src, tmp_path / "out")
    assert str(e.value).startswith(message), str(e.value)
    assert "--" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--format", "fp4"], "--format 'fp4': expected one of"),
        (["--format", "bf16", "--target", "gaudi2"], "--target gaudi2: a bf16 output has no FP8 range"),
        (["--ignore", "nomatch"], "--ignore 'nomatch' matches none of the 104 linears"),
        (["--base-model", "./here"], "--base-model './here': expected a Hub"),
    ],
)
def test_the_command_line_names_its_flags(tiny_src, tmp_path, flags, message):
    line = cli_error(["convert", str(tiny_src), "--out", str(tmp_path / "o"), *flags], tmp_path / "o")
    assert line.startswith(f"error: {message}"), line


def test_card_speaks_the_librarys_terms_and_the_command_its_flags(tiny_src, tmp_path):
    plain = tmp_path / "plain"
    mla_convert.convert(tiny_src, plain, card=False)
    with pytest.raises(mla_convert.OutputError, match=r"converted with card=False: its README.md is the source's"):
        mla_convert.card(plain)
    with pytest.raises(mla_convert.OutputError, match=r"^base_model='\./x': expected a Hub model id"):
        mla_convert.card(plain, base_model="./x")
    line = cli_error(["card", str(plain)], tmp_path / "nothing")
    assert "converted with --no-card: its README.md" in line
    line = cli_error(["card", str(plain), "--repo-id", "./x"], tmp_path / "nothing")
    assert line.startswith("error: --repo-id './x': expected a Hub model id"), line


def test_options_and_run_settings_refusals_are_option_errors():
    with pytest.raises(mla_convert.ConvertError) as e:
        Options(target="gaudi9")
    assert e.value.flags == "--target 'gaudi9': expected one of gaudi3, gaudi2"
