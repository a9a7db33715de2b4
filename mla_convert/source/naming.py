"""How a checkpoint names its tensors, against the DeepSeek-V3 names that the family's rules
(source.family) are written in.

Three ways, from the members' real checkpoints (which member names its tensors how: its
`Member.names` in source/members/):

- DeepSeek-V3's own names: `model.layers.N.self_attn...`.
- The same names behind a prefix (a multimodal wrapper's `language_model.`), next to the tensors of
  a vision part.
- A member's own layout with names of its own (a TensorNames subclass in its member module).

The output keeps the source's names. A tensor of another part of the model (vision) has no
DeepSeek name: it is copied as it is. `config_module` gives a module's name as vLLM's
quantization config matches it (its `ignore` and `targets`), which is vLLM's module name after its
own name mapping. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorNames:
    """DeepSeek-V3's names, as they are."""

    extra_prefixes: tuple[str, ...] = ()  # tensors of other parts of the model (vision), copied as they are

    def module_to_deepseek(self, module: str) -> str | None:
        """The DeepSeek-V3 name of a module; None for one of another part (vision) or an unknown one."""
        return None if self.is_extra(module) else module

    def module_from_deepseek(self, module: str) -> str:
        """The checkpoint's own name of a DeepSeek-V3 module name."""
        return module

    def to_deepseek(self, name: str) -> str | None:
        """The DeepSeek-V3 name of a tensor ('<module>.<suffix>'); None as module_to_deepseek."""
        module, _, suffix = name.rpartition(".")
        deepseek = self.module_to_deepseek(module) if module else None
        return None if deepseek is None else f"{deepseek}.{suffix}"

    def from_deepseek(self, name: str) -> str:
        """The checkpoint's own name of a DeepSeek-V3 tensor name."""
        module, _, suffix = name.rpartition(".")
        return f"{self.module_from_deepseek(module)}.{suffix}"

    def config_module(self, module: str) -> str:
        """A module's name (the checkpoint's) as vLLM's quantization config matches it."""
        return module

    def is_extra(self, name: str) -> bool:
        return name.startswith(self.extra_prefixes)


@dataclass(frozen=True)
class PrefixedNames(TensorNames):
    """DeepSeek-V3's names behind a prefix (a wrapper's `language_model.`), next to a vision tower
    and projector. vLLM's module names are the checkpoint's."""

    extra_prefixes: tuple[str, ...] = ("vision_tower.", "mm_projector.")
    prefix: str = "language_model."

    def module_to_deepseek(self, module: str) -> str | None:
        return module[len(self.prefix) :] if module.startswith(self.prefix) else None

    def module_from_deepseek(self, module: str) -> str:
        return self.prefix + module


DEEPSEEK_NAMES = TensorNames()
