"""The plugin's per-process serving state, owned by one object (absorbed.py acts on it).

vLLM builds each MLA layer once per process and may reload its weights later, so what the plugin
learns lives as long as the process: where each served model's artifacts are (opened on first
use), what each layer's first call did (so a reload is told apart), the layers inside a wrapper
now, and the log lines said once. `current()` is that object; `reset()` forgets all of it, the one
way tests start afresh. Standard library only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServingState:
    # served model (or $MLA_RUNTIME_DIR) -> its artifacts source (absorbed._Source); None: no artifacts
    sources: dict[str, Any] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)  # layers inside a wrapper now (vllm-gaudi's method calls upstream's)
    said: set[str] = field(default_factory=set)  # once-per-process log lines already written
    # layer -> (source, outcome) of its first call; by id for a layer that takes no weak reference
    _first: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    _first_by_id: dict[int, tuple] = field(default_factory=dict)

    def first_call(self, layer) -> tuple | None:
        try:
            return self._first.get(layer)
        except TypeError:
            return self._first_by_id.get(id(layer))

    def remember(self, layer, first: tuple) -> None:
        try:
            self._first[layer] = first
        except TypeError:
            self._first_by_id[id(layer)] = first

    def clear(self) -> None:
        self.sources.clear()
        self.active.clear()
        self.said.clear()
        self._first.clear()
        self._first_by_id.clear()


_STATE = ServingState()  # the process's one owner (a plugin is loaded once per process)


def current() -> ServingState:
    return _STATE


def reset() -> None:
    """Forget everything the plugin learnt in this process (tests)."""
    _STATE.clear()
