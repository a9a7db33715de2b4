"""What each `--ignore` pattern does to a plan: how many linears it leaves unquantized, and a
refusal for a pattern that leaves none (a typo would otherwise quantize what the user meant to
keep, silently).

The linears a pattern can keep are the ones the conversion would otherwise quantize: the source's
block-FP8 weights, and a BF16 source's linears that channel FP8 quantizes (planner.quantizable).
A pattern is matched as the planner matches it (re.match on the module name as vLLM names it); a linear matched
by two patterns counts for each. Computed from a made plan and its source, never by planning again.
"""

from __future__ import annotations

import re

from mla_convert.errors import OptionError
from mla_convert.plan.planner import Plan, natural, quantizable
from mla_convert.source.checkpoint import module_of

EXAMPLES = 4  # module names a refusal lists to show what patterns are matched against


def convertible_linears(plan: Plan) -> list[str]:
    """The modules whose weight the conversion quantizes unless a pattern keeps it, in layer order."""
    src = plan.source
    modules = {module_of(name) for name in src.block_fp8}
    modules |= {module_of(name) for name in src.weight_map if quantizable(src, name)}
    # in the names the planner matches: vLLM's, after its own mapping (a member's own names, a wrapper's prefix)
    return sorted({src.names.config_module(m) for m in modules}, key=natural)


def kept_by_pattern(plan: Plan) -> dict[str, int]:
    """Each --ignore pattern -> how many of the convertible linears it matches (leaves unquantized)."""
    linears = convertible_linears(plan)
    return {p: sum(1 for m in linears if re.match(p, m)) for p in plan.options.ignore}


def check_patterns(plan: Plan) -> dict[str, int]:
    """kept_by_pattern, refusing (one line) a pattern that matches no convertible linear."""
    counts = kept_by_pattern(plan)
    unmatched = [p for p, n in counts.items() if n == 0]
    if unmatched:
        linears = convertible_linears(plan)
        why = (
            f"matches none of the {len(linears)} linears this conversion quantizes; patterns are regular "
            f"expressions matched at the start of module names such as {', '.join(examples(linears))}"
        )
        raise OptionError(f"ignore pattern '{unmatched[0]}' {why}", f"--ignore '{unmatched[0]}' {why}")
    return counts


def examples(modules: list[str]) -> list[str]:
    """A few module names of different kinds (attention, dense MLP, expert, ...), the first of each:
    the kind is the module's parent with its numbers left out."""
    seen: dict[str, str] = {}
    for m in modules:
        seen.setdefault(re.sub(r"\d+", "N", m.rpartition(".")[0]), m)
        if len(seen) == EXAMPLES:
            break
    return list(seen.values())
