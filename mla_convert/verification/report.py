"""The verification report: check groups, failures that name file and tensor, and worst-tensor stats.

A `Tally` is filled by every part of `verify` (the header pass in the main process, each file's
streaming pass in a worker, through a `FileTally` that names the file) and merged; `as_report`
turns the merged tally into the VerifyReport (mla_convert.results) that the CLI prints as a
table or, `to_json()`, as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mla_convert.results import CheckGroup, Failure, TensorStats, VerifyReport

STRUCTURE, INTEGRITY, VALUES, SOURCE, MLA = GROUPS = ("structure", "integrity", "values", "source", "mla")
GROUP_TITLES = {
    STRUCTURE: "config, index, shard headers, tensor set, quantization_config, MLA manifest",
    INTEGRITY: "file sizes and sha256 against the conversion manifest, side files",
    VALUES: "no NaN/Inf, scales finite and > 0, FP8 values in range (the format's and the target's checks)",
    SOURCE: "every tensor against the exact fp32 dequant of --source",
    MLA: "W_UK_T / W_UV against kv_b_proj, absorbed vs naive attention",
}
MAX_LISTED = 50  # failures listed per group (all are counted)
NOTHING_CHECKED = "nothing was checked"  # a group that ran no check: it did not pass (an unfinished output)
MAX_WORST = 5  # worst converted tensors kept for the report


@dataclass
class Tally:
    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))
    failures: list[Failure] = field(default_factory=list)
    worst: list[TensorStats] = field(default_factory=list)
    bytes_read: int = 0

    def ok(self, group: str, n: int = 1) -> None:
        self.checked[group] += n

    def fail(self, group: str, check: str, file=None, tensor=None, *, expected="", found="") -> None:
        self.checked[group] += 1
        self.failures.append(Failure(group, check, file, tensor, str(expected), str(found)))

    def expect(self, cond: bool, group: str, check: str, file=None, tensor=None, *, expected="", found="") -> bool:
        """Count one check; record a failure when `cond` is false. Returns `cond`."""
        if cond:
            self.ok(group)
        else:
            self.fail(group, check, file, tensor, expected=expected, found=found)
        return cond

    def add_stats(self, stats: TensorStats) -> None:
        self.worst.append(stats)
        self.worst.sort(key=lambda s: (-s.bound_use, -s.rel_err))
        del self.worst[MAX_WORST:]

    def merge(self, other: Tally) -> None:
        for g in GROUPS:
            self.checked[g] += other.checked[g]
        self.failures += other.failures
        self.bytes_read += other.bytes_read
        for s in other.worst:
            self.add_stats(s)


@dataclass
class FileTally:
    """One file's checks, recorded in `tally` under the file's name."""

    tally: Tally
    rel: str  # the file, relative to the verified directory

    def expect(self, cond: bool, group: str, check: str, tensor=None, *, expected="", found="") -> bool:
        return self.tally.expect(cond, group, check, self.rel, tensor, expected=expected, found=found)

    def fail(self, group: str, check: str, tensor=None, *, expected="", found="") -> None:
        self.tally.fail(group, check, self.rel, tensor, expected=expected, found=found)

    def verdict(self, bad, group: str, check: str, tensor, expected: str, total: int, what: str = "") -> None:
        """Record one check over a tensor: it passed when `bad` (an error_stats.Mismatches, over `total`
        elements) counted none."""
        self.expect(not bad.count, group, check, tensor, expected=expected, found=what + bad.text(total))

    def stats(self, tensor: str, op: str, st) -> None:
        """How far a converted tensor is from its source (`st`: an error_stats.ErrorStats over it)."""
        self.tally.add_stats(TensorStats(self.rel, tensor, op, st.max_abs, st.rel_err, st.cosine, st.bound_use))


def as_report(tally: Tally, skipped: dict[str, str], info: dict) -> VerifyReport:
    """The full report (`info`: its header fields): exit_code 0 when every check that ran passed,
    1 otherwise. A group that ran no check and was not skipped on purpose says so (NOTHING_CHECKED),
    never that it passed."""
    groups = {}
    for g in GROUPS:
        fails = [f for f in tally.failures if f.group == g]
        groups[g] = CheckGroup(
            title=GROUP_TITLES[g],
            checked=tally.checked[g],
            failed=len(fails),
            skipped=skipped.get(g) or (NOTHING_CHECKED if not tally.checked[g] else None),
            failures=tuple(fails[:MAX_LISTED]),
            failures_not_listed=max(0, len(fails) - MAX_LISTED),
        )
    ok = not tally.failures
    return VerifyReport(
        **info, ok=ok, exit_code=0 if ok else 1, groups=groups, worst_tensors=tuple(tally.worst),
        bytes_read=tally.bytes_read,
    )  # fmt: skip
