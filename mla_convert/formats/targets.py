"""The targets an output's FP8 range is chosen for (`--target`), declared once: each one's largest
e4m3 magnitude, whether its FP8 weights may hold -0, and what its card adds. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    fp8_max: float  # the largest e4m3 magnitude its FP8 range holds
    # Whether its FP8 weights may hold e4m3fn's -0 (code 0x80). Gaudi2's nominal format is
    # float8_e4m3fnuz, in which 0x80 is NaN: its outputs write every zero as +0.
    signed_zero: bool
    card_note: str = ""  # a line of the card's "What was not verified", for an output whose bytes depend on it


GAUDI3 = Target("gaudi3", 448.0, True)
GAUDI2 = Target(
    "gaudi2",
    240.0,
    False,
    "For Gaudi2 (`--target gaudi2`): how vllm-gaudi's scale adjustment treats these weights is read from its "
    "source, not measured.",
)
TARGETS = {t.name: t for t in (GAUDI3, GAUDI2)}
DEFAULT_TARGET = GAUDI3.name
