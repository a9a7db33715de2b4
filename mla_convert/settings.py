"""What a conversion produces (`Options`) and how it runs (`RunSettings`): two frozen objects passed
from the command line (or a library caller) down to the shard jobs.

`Options` says what the output is and is recorded in its manifest (a `--resume` must match it);
`RunSettings` says how to get there and changes no output byte. Each field mirrors a `convert`
flag; the defaults here are the only ones (the CLI takes its own from here). No torch here: the
CLI builds both while torch is still loading.

A refused value is an OptionError: its message names the field as the library's keyword
(`target='gaudi2'`), its `flags` as the command line's flag (`--target gaudi2`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mla_convert import formats
from mla_convert.constants import KERNEL_MODES, WRITE_AUTO, WRITE_MODES
from mla_convert.errors import ConvertError, OptionError
from mla_runtime import hub_cache

ProgressFn = Callable[[int], None]  # advance(nbytes): called with source bytes processed
ProgressFactory = Callable[[int], ProgressFn]  # factory(total_bytes) -> advance
MessageFn = Callable[[str], None]

# A Hub repo id, OWNER/NAME, for a Hub source, an upload's REPO_ID and a card's base_model: the
# runtime's pattern (huggingface_hub's validate_repo_id rules, with the owner required).
REPO_ID = hub_cache.REPO_ID
REPO_ID_MAX = 96


def is_repo_id(name) -> bool:
    """A Hub repo id: OWNER/NAME, no `--` or `..`, at most REPO_ID_MAX characters."""
    return (
        isinstance(name, str)
        and len(name) <= REPO_ID_MAX
        and bool(REPO_ID.match(name))
        and "--" not in name
        and ".." not in name
        and not name.endswith((".git", "."))
    )


def is_repo_target(target: str | Path) -> bool:
    """Whether `target` names a Hub repo: an OWNER/NAME that is not a path here (an existing local
    file or directory always wins, relative ones included)."""
    return not Path(target).expanduser().exists() and is_repo_id(str(target))


def refused(field: str, value, why: str, flag: str | None = None, flag_value: str | None = None) -> OptionError:
    """OptionError for `value` of option `field`: `field=value: why` for the library, `--flag value:
    why` for the command line (`flag`: the field's flag where it is not --field; `flag_value`: the
    value as the command line shows it, where not its repr)."""
    flag = flag or "--" + field.replace("_", "-")
    shown = repr(value) if flag_value is None else flag_value
    return OptionError(f"{field}={value!r}: {why}", f"{flag} {shown}: {why}")


@dataclass(frozen=True)
class Options:
    format: str = formats.DEFAULT_FORMAT  # formats.names()
    target: str = formats.DEFAULT_TARGET  # formats.TARGETS: the FP8 range
    ignore: tuple[str, ...] = ()  # regexes (re.match) on module names to leave unquantized (bf16)
    card: bool = True  # README.md is the output's own model card (False: the source's README, unchanged)
    # The card's base_model, a Hub model id. Recorded with the source in the manifest (not among
    # the options: `mla-convert card` may set it later, and a --resume may name another).
    base_model: str | None = None

    def __post_init__(self):
        if self.base_model is not None and not is_repo_id(self.base_model):
            why = "expected a Hub model id, OWNER/NAME (the model this one derives from), not a path or a URL"
            raise refused("base_model", self.base_model, why)
        if not isinstance(self.card, bool):
            raise ConvertError(f"card {self.card!r}: expected True or False")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) for p in self.ignore):
            raise ConvertError(f"ignore {self.ignore!r}: expected a sequence of regular expressions")
        object.__setattr__(self, "ignore", tuple(self.ignore))  # a list given is kept as a tuple
        if formats.find(self.format) is None:
            raise refused("format", self.format, f"expected one of {', '.join(formats.names())}")
        if self.target not in formats.TARGETS:
            raise refused("target", self.target, f"expected one of {', '.join(formats.TARGETS)}")
        for p in self.ignore:
            try:
                re.compile(p)
            except re.error as e:
                raise OptionError(
                    f"ignore pattern {p!r}: not a valid regular expression ({e})",
                    f"--ignore {p!r}: not a valid regular expression ({e})",
                ) from e

    def check_new_conversion(self) -> None:
        """What a new conversion refuses that a recorded one may hold (verify reads manifests of
        earlier versions): a target the format does not take (formats.Format.refuses_target; a
        bf16 output has no FP8 range: every target gives the same bytes, so a target other than the
        default would be recorded for a difference that is not there)."""
        why = self.output_format.refuses_target(self.target)
        if why is not None:
            ranged = [f.name for f in formats.all_formats() if f.fp8_range]
            raise OptionError(
                f"target={self.target!r}: {why}; leave target out (it applies to format="
                + " or ".join(map(repr, ranged))
                + ")",
                f"--target {self.target}: {why}; leave --target out (it applies to --format "
                + " or ".join(ranged)
                + ")",
            )

    @property
    def output_format(self) -> formats.Format:
        """The format (formats.Format) this output is written in."""
        return formats.get(self.format)

    @property
    def fp8_max(self) -> float:
        return formats.TARGETS[self.target].fp8_max

    @property
    def signed_zero(self) -> bool:
        """Whether the target's FP8 weights may hold -0 (formats.Target.signed_zero)."""
        return formats.TARGETS[self.target].signed_zero

    def as_dict(self) -> dict:
        return {"format": self.format, "target": self.target, "ignore": list(self.ignore), "card": self.card}


@dataclass(frozen=True)
class RunSettings:
    workers: int = 1  # shard jobs at once; above 1 they run in spawned worker processes
    device: str = "cpu"  # torch device for the arithmetic
    kernels: str = "auto"  # KERNEL_MODES; resolved per conversion (kernels.modes.resolve_mode)
    write_io: str = WRITE_AUTO  # WRITE_MODES; resolved for the output directory
    revision: str | None = None  # Hub branch, tag or commit of the source
    stream: bool = False  # Hub source: download each shard just in time, delete it once converted
    dry_run: bool = False  # plan and report; write nothing
    resume: bool = False  # finish an interrupted conversion in the output directory
    overwrite: bool = False  # replace an earlier mla-convert output in the output directory
    ignore_free_space: bool = False  # write even where the filesystems report too little free space
    progress_factory: ProgressFactory | None = field(default=None, compare=False, repr=False)
    status: MessageFn | None = field(default=None, compare=False, repr=False)  # what runs now (transient)
    notice: MessageFn | None = field(default=None, compare=False, repr=False)  # a line worth keeping in a log

    def __post_init__(self):
        if self.write_io not in WRITE_MODES:
            raise OptionError(
                f"write_io={self.write_io!r}: unknown mode; expected one of {', '.join(WRITE_MODES)}",
                f"--write-io: unknown mode {self.write_io!r}; expected one of {', '.join(WRITE_MODES)}",
            )
        if self.kernels not in KERNEL_MODES:
            raise OptionError(
                f"kernels={self.kernels!r}: expected one of {', '.join(KERNEL_MODES)}",
                f"--kernels: kernels mode {self.kernels!r}: expected {', '.join(KERNEL_MODES)}",
            )


@dataclass(frozen=True)
class UploadOptions:
    """How `upload` publishes a conversion (each field mirrors an `upload` flag); no output byte depends on it."""

    revision: str | None = None  # the branch; None: main
    private: bool = False  # a repo `create` makes is private
    create: bool = False  # make the repo and the branch if missing
    overwrite: bool = False  # replace another model's files in the branch
    skip_verify: bool = False  # no structure and integrity checks first
    dry_run: bool = False  # the files and the commits; no network, no hashing
