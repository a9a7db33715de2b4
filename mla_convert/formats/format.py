"""What an output format declares (docs/adding-a-format.md): the record every format module fills
in, and the registry that answers for them (no torch here: the command line reads the names and
help words while torch is still loading).

A format says, in one place:

- what each kind of source tensor becomes (`Becomes`: the transform, kernels.transforms, that makes
  it, the dtype written, and the scale written right after it, `ScaleLayout`): a block-FP8 weight,
  a 16-bit linear the member's FP8 releases quantize, an INT4 weight; a linear the user ignores
  (`--ignore`) stays in 16 bits whatever the format;
- the `quantization_config` it writes, and how verify reads one back (which scheme it gives each
  linear, what keeps it from being this format's);
- the value checks verify runs on its tensors (verification.values names them);
- how its card and the console describe it;
- which targets it takes.

Generic code asks the format and never compares its name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from mla_convert.errors import ConvertError
from mla_convert.formats.targets import DEFAULT_TARGET, TARGETS, Target
from mla_convert.registry import Registry

# The scheme a quantization_config gives a linear (Format.claimed): the format's own quantized
# scheme (reported by the format's name), the source's INT4 group kept as it is, or none.
QUANTIZED, INT4, IGNORED = "quantized", "int4", "unquantized"


@dataclass(frozen=True)
class ScaleLayout:
    """A quantized weight's scale: a tensor of its own, written right after its weight."""

    suffix: str  # the scale's name: the weight's module + suffix
    dtype: str  # its safetensors dtype
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # its shape, from its weight's

    def name(self, weight: str) -> str:
        """The scale of the weight tensor `weight` (MODULE.weight)."""
        return weight.rsplit(".", 1)[0] + self.suffix


@dataclass(frozen=True)
class Becomes:
    """What one kind of source tensor becomes in a format's output."""

    op: str  # the transform that makes it (its name in kernels.transforms and in a plan)
    dtype: str  # the safetensors dtype written
    scale: ScaleLayout | None = None  # the scale written right after it, for a quantized weight


class Format:
    """One output format. A subclass fills in the class attributes and the methods that differ;
    `register` makes it one of `--format`'s choices."""

    name: ClassVar[str]  # `--format`'s value, recorded in the manifest and the card
    rank: ClassVar[int] = 100  # its place in every list (the first is the default)
    help: ClassVar[str]  # its words in `--format`'s help
    words: ClassVar[str]  # what the card's title and the model's name call it ("channel FP8")
    # What each kind of source tensor becomes.
    block_fp8: ClassVar[Becomes]  # a block-FP8 weight
    float_linear: ClassVar[Becomes | None] = None  # a 16-bit linear the member's FP8 releases quantize; None: copied
    int4: ClassVar[Becomes | None] = None  # a pack-quantized INT4 weight; None: copied as the source has it
    fp8_range: ClassVar[bool] = True  # its bytes depend on the target's FP8 range: it takes every target
    value_checks: ClassVar[tuple[str, ...]] = ("nan-inf",)  # verification.values' names, for its tensors
    tags: ClassVar[tuple[str, ...]] = ()  # the card's Hub tags for it
    base_model_relation: ClassVar[str | None] = None  # the card's, where it names a base model

    # ---- the tensors ---------------------------------------------------------------------------

    @property
    def quantizes(self) -> bool:
        """Whether it writes quantized weights (with their scales) and a quantization_config."""
        return self.block_fp8.scale is not None

    def scale_of(self, op: str) -> ScaleLayout | None:
        """The scale written after a weight made by `op` (None: none)."""
        for b in (self.block_fp8, self.float_linear):
            if b is not None and b.op == op:
                return b.scale
        return None

    def scale_name(self, weight: str) -> str | None:
        """The name of the scale a quantized weight `weight` has in this format (None: none)."""
        return self.block_fp8.scale.name(weight) if self.block_fp8.scale else None

    def ops(self) -> tuple[str, ...]:
        """The transforms it names."""
        return tuple(b.op for b in (self.block_fp8, self.float_linear, self.int4) if b is not None)

    # ---- the quantization_config ----------------------------------------------------------------

    def quantization_config(self, ignore: list[str], int4=None, int4_targets: list[str] | None = None) -> dict | None:
        """The quantization_config it writes (None: none); `ignore`: the linears left unquantized;
        `int4`: an INT4 source's group (source.quantization.Int4Scheme) it keeps, `int4_targets`
        naming exactly its modules."""
        return None

    def config_problem(self, qc, present: bool) -> str | None:
        """What keeps an output's quantization_config `qc` (`present`: the config has one) from being
        this format's; None: nothing."""
        return repr(qc)[:200] if present else None

    def config_expected(self) -> str:
        """What verify's message says a quantization_config must be instead."""
        return f"none ({self.name} output)"

    def claimed(self, module: str, qc: dict) -> str:
        """The scheme `qc` gives a linear (by vLLM's module name): QUANTIZED, INT4 or IGNORED."""
        return IGNORED

    def scheme_label(self, scheme: str) -> str:
        """A scheme as verify's messages name it."""
        return self.name if scheme == QUANTIZED else scheme

    # ---- targets ------------------------------------------------------------------------------

    def refuses_target(self, target: str) -> str | None:
        """Why a new conversion to this format refuses `target` (None: it takes it)."""
        if self.fp8_range or target == DEFAULT_TARGET:
            return None
        return f"a {self.name} output has no FP8 range and is the same for every target"

    # ---- how the card and the console describe it ------------------------------------------------

    def label(self, target: str, fp8_max: float | None = None) -> str:
        """The format as the console titles it: with its target (and FP8 max) where its bytes depend on it."""
        if not self.fp8_range:
            return self.name
        return f"{self.name} / {target}" + (f" (FP8 max {fp8_max:g})" if fp8_max is not None else "")

    def card_words(self, target: str, fp8_max: float) -> str:
        """The card's words for the output's format ('converted to ...', its Conversion row)."""
        return self.words

    def card_flags(self, target: str) -> str:
        """`convert`'s flags that give this format and target."""
        return f" --format {self.name}" + (f" --target {target}" if self.fp8_range else "")

    def card_weights(self, facts) -> str:
        """The card's section on the weights (`facts`: output.card_facts.CardFacts)."""
        raise NotImplementedError

    def card_serving_note(self) -> str:
        """A sentence the card's serving section adds for it ('' for none)."""
        return ""

    def card_target_note(self, target: str) -> str:
        """The target's line of the card's "What was not verified" ('' for none)."""
        known = TARGETS.get(target)
        return known.card_note if known is not None and self.fp8_range else ""


# The formats by name, in rank order; the built-in ones register like any other (formats.builtin).
_REGISTRY: Registry[Format] = Registry("format", {}, lambda f: f.name, order=lambda f: f.rank)


def register(fmt: Format) -> Format:
    """Make `fmt` one of `--format`'s choices; ValueError if its name is taken."""
    return _REGISTRY.add(fmt)


def unregister(name: str) -> None:
    _REGISTRY.remove(name)


def seal_built_ins() -> None:
    """The formats registered so far (the package's own) are built in: unregister leaves them."""
    _REGISTRY.seal()


@contextlib.contextmanager
def registered(fmt: Format) -> Iterator[Format]:
    """`fmt` registered while the block runs (tests, a plugin's scope)."""
    with _REGISTRY.scoped([fmt]):
        yield fmt


def all_formats() -> tuple[Format, ...]:
    return tuple(_REGISTRY.items.values())


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY.items)


def find(name) -> Format | None:
    """The format named `name`; None for a name no format has (a manifest's, read as it is)."""
    return _REGISTRY.items.get(name) if isinstance(name, str) else None


def get(name: str) -> Format:
    """The format named `name`; ConvertError naming the choices otherwise."""
    fmt = find(name)
    if fmt is None:
        raise ConvertError(f"format {name!r}: expected one of {', '.join(names())}")
    return fmt


def target(name: str) -> Target:
    """The target named `name`; ConvertError naming the choices otherwise."""
    if name not in TARGETS:
        raise ConvertError(f"target {name!r}: expected one of {', '.join(TARGETS)}")
    return TARGETS[name]
