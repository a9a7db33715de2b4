"""--help as a user types the command: `mla-convert convert [OPTIONS] SOURCE`, `--out DIR`,
`--ignore REGEX`, flags without a type, in plain text that wraps at the terminal's width and never
cuts an example off (the app runs with Typer's rich help off: its table leaves a 20-column help
column at 80 columns and ends long words with an ellipsis).

Typer shows each parameter's Python type (`<bool>`, `<list[str]>`, `<path>`) and a required
argument as `{source}`; `Command` shows the option's metavar (set in cli.options) and the
argument's name in capitals instead.

click wraps help text as textwrap does by default, also after a hyphen: a demo member's name
came out cut at one of its hyphens, a name that no longer copies. `whole_words` wraps
between words only (a word longer than the line is still cut)."""

from __future__ import annotations

import contextlib
import importlib
import re

from typer.core import TyperCommand

from mla_convert import formats
from mla_convert.source import members

_TYPE = re.compile(r" <[^<>]*>")  # Typer's type label after a name: ' <str>', ' <list[str]>'


def _argument_name(param) -> str:
    return param.metavar or param.name.upper()


@contextlib.contextmanager
def whole_words(formatter):
    """While `formatter` (click's HelpFormatter, Typer's copy of click or click itself) writes:
    lines wrap at spaces, never after a hyphen inside a name."""
    try:  # the wrapper click's wrap_text imports as it runs
        textwrap = importlib.import_module(type(formatter).__module__.rpartition(".")[0] + "._textwrap")
    except ImportError:
        textwrap = None
    original = getattr(textwrap, "TextWrapper", None)
    if original is None:  # another click layout: its own wrapping, as it was
        yield
        return

    class WholeWords(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "break_on_hyphens": False})

    textwrap.TextWrapper = WholeWords
    try:
        yield
    finally:
        textwrap.TextWrapper = original


class Command(TyperCommand):
    """A Typer command whose usage line and help rows read as a user types them."""

    def format_help(self, ctx, formatter) -> None:
        with whole_words(formatter):
            super().format_help(ctx, formatter)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = _argument_name(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx, formatter) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            name, text = record
            if param.param_type_name == "argument":
                args.append((_argument_name(param), text))
            else:
                opts.append((_TYPE.sub("", name), text))
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def app_summary() -> str:
    """The app's one-paragraph help: the members' short names (source/members/), the inputs, the
    output formats (formats/)."""
    names = ", ".join(m.short for m in members.all_members() if m.short)
    words = " or ".join(f.words for f in formats.all_formats())
    return (
        f"Convert MLA checkpoints of the DeepSeek-V3 family ({names}; block-FP8, BF16, or pack-quantized INT4 "
        f"experts) for vLLM on Intel Gaudi ({words}), with each MLA layer's W_UK_T / W_UV precomputed "
        "next to the model."
    )
