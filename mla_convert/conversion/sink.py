"""Where a conversion's files go once written, besides staying in --out: the seam between the
conversion (this package) and `convert --upload` (publish.hub_to_hub), which checks each shard
job's files, sends them to the Hub and deletes them, within a disk budget.

The pipeline calls a sink at these points, in order; `Sink` itself does nothing at any of them (a
plain conversion has none):

- `planned(plan, repo, origin)`, after the plan, before anything is written: every refusal of the
  upload (the Hub, the budget); returns the result's fields (a dry run stops after them);
- `held`: what the Hub's branch holds, for --resume (output.journal.resumable_jobs);
- `resumed(kept)`, once the preflight knows the kept jobs: a refusal of what they leave too
  little room for; the result's fields;
- `to_check(kept)`: which kept jobs need their source shards again;
- `started(run, sources)`, once --out is ready: the jobs, the journal, the source shards
  (`Sources`: the sink releases a job's once it no longer needs them); its threads start;
- `budget`, `extra(job)`, `admit(job, timeout)`, `clock`: each job's room, reserved before it
  starts (with --stream, by the downloader, its shards with it);
- `written(job, files)`, after a job's files are journaled;
- `finishing()` before the last stage, `finished(files)` after it: the files that make the
  directory a model; returns the result's fields once everything is where it goes;
- `close(error)`: the run ends (error None) or failed; the sink's threads stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mla_convert.conversion.stages import StageClock
from mla_convert.output.journal import Held, JobFiles, Journal
from mla_convert.plan.planner import Plan


@dataclass
class Run:
    """What a sink is told when the jobs start."""

    plan: Plan
    out_dir: Path
    journal: Journal
    kept: dict[str, JobFiles]  # --resume: jobs whose files are on disk or on the Hub
    todo: list[str]  # the jobs to convert, in order
    inputs: dict[str, list[str]] = field(default_factory=dict)  # job -> its source files


class Sources(Protocol):
    """A job's source files, for a sink: `wait(job, timeout)` until they are on disk (--stream: the
    downloader), `release(job)` once the job no longer needs them."""

    def wait(self, job: str, timeout: float | None = None) -> bool: ...

    def release(self, job: str) -> None: ...


class Sink:
    active = False  # a plain conversion's: the pipeline runs as if there were none
    budget = None  # output.budget.DiskBudget, or None: no budget
    clock: StageClock | None = None

    @property
    def held(self) -> Held | None:
        return None

    def planned(self, plan: Plan, repo, origin) -> dict:
        return {}

    def resumed(self, kept: dict[str, JobFiles]) -> dict:
        return {}

    def to_check(self, kept: dict[str, JobFiles]) -> list[str]:
        """The kept jobs whose source files must be on disk again (to be checked); in order."""
        return []

    def started(self, run: Run, sources: Sources) -> None:
        pass

    def extra(self, job: str) -> int:
        """The bytes a job's output files take on disk, reserved with its source shards."""
        return 0

    def admit(self, job: str, timeout: float | None) -> bool:
        """Whether `job` may start (its room reserved), waiting up to `timeout`."""
        return True

    def written(self, job: str, files: JobFiles) -> None:
        pass

    def finishing(self) -> None:
        """Before the last stage writes its files."""

    def finished(self, files: dict[str, dict]) -> dict:
        return {}

    def raise_error(self) -> None:
        """Raise what failed in the sink's own threads, if anything did."""

    def close(self, error: BaseException | None) -> None:
        pass
