"""How a conversion runs, as one frozen object passed from the command line down to the shard jobs.

`Options` (plan.py) says what the output is and is recorded in its manifest; `RunSettings` says how
to get there and changes no output byte. Each field mirrors a `deepseek-r1` flag; the defaults
here are the only ones (the CLI takes its own from here, so this module stays free of torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .disk_write import AUTO as WRITE_AUTO
from .disk_write import MODES as WRITE_MODES
from .errors import ConvertError

ProgressFn = Callable[[int], None]  # advance(nbytes): called with source bytes processed
ProgressFactory = Callable[[int], ProgressFn]  # factory(total_bytes) -> advance
MessageFn = Callable[[str], None]


@dataclass(frozen=True)
class RunSettings:
    workers: int = 1  # shard jobs at once; above 1 they run in spawned worker processes
    device: str = "cpu"  # torch device for the arithmetic
    kernels: str = "auto"  # kernels.MODES; resolved per conversion (kernels.resolve_mode)
    write_io: str = WRITE_AUTO  # disk_write.MODES; resolved for the output directory
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
            raise ConvertError(f"--write-io: unknown mode {self.write_io!r}; expected one of {', '.join(WRITE_MODES)}")
        from .kernels import MODES as KERNEL_MODES  # here: importing kernels imports torch

        if self.kernels not in KERNEL_MODES:
            raise ConvertError(f"--kernels: kernels mode {self.kernels!r}: expected {', '.join(KERNEL_MODES)}")
