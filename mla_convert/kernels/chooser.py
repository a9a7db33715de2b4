"""The one chooser: the first of a list of implementations, fastest first, that passes its probes
on this machine, a pass remembered (kernels.verdict). The conversion's kernel sets
(kernels.fastest) and verify's readers (verification.readers) are chosen by it. No torch here: a
pass remembered is taken without probing where the candidate allows it (verify's readers), so
without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mla_convert.kernels import verdict


class Unusable(Exception):
    """An implementation that cannot be used here (the message says why)."""


class Differed(Unusable):
    """Ran, and gave other results than the definition."""


@dataclass(frozen=True)
class Candidate:
    """One implementation to try: `key()` names its record in kernels.verdict (None: none is
    kept), `make()` builds it, `check(impl)` probes it and returns why it passes (each raises
    Unusable, saying why). A pass is recorded, a failure forgets the record. With `recorded`, a
    pass recorded before is taken without probing: recorded(what the record says) is why."""

    name: str
    make: Callable[[], Any]
    check: Callable[[Any], str]
    key: Callable[[], str] | None = None
    ops: tuple[str, ...] = ()  # what the record says was checked
    recorded: Callable[[str], str] | None = None


def first_passing(candidates: Iterable[Candidate]) -> tuple[Any, str, list[str]]:
    """(the first candidate's implementation that passes, why, why each one before it did not);
    (None, "", the reasons) where none does."""
    skipped: list[str] = []
    for c in candidates:
        try:
            key = c.key() if c.key else None
            found = verdict.lookup(key) if key and c.recorded else None
            impl = c.make()
            if found is not None:
                return impl, c.recorded(found), skipped
            try:
                why = c.check(impl)
            except Unusable:
                if key:
                    verdict.record(key, False, c.ops, _torch_version())
                raise
            if key:
                verdict.record(key, True, c.ops, _torch_version())
            return impl, why, skipped
        except Unusable as e:
            skipped.append(str(e))
    return None, "", skipped


def _torch_version() -> str:
    import torch  # a probe has run: torch is imported already

    return torch.__version__
