"""One shape for the project's registries (output formats, plan transforms, value checks, source
comparisons): items by name in a dict that other modules read, the built-in ones fixed, others
added and removed by a plugin or a test, or for the length of a block.

Each registry module keeps its own `register` (which may check more before adding), `unregister`
and `registered`, written on this class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """`items` (mutated in place: readers hold the dict) by `name_of(item)`; the names in it now
    are built in and never removed (`seal` makes those added since built in too). `order`: a sort
    key kept over the items after each add."""

    def __init__(
        self, kind: str, items: dict[str, T], name_of: Callable[[T], str], order: Callable[[T], object] | None = None
    ):
        self.kind, self.items, self.name_of, self.order = kind, items, name_of, order
        self.seal()

    def seal(self) -> None:
        self.built_in = frozenset(self.items)

    def add(self, item: T) -> T:
        """ValueError for a name taken."""
        name = self.name_of(item)
        if name in self.items:
            raise ValueError(f"a {self.kind} named {name!r} is registered already")
        self.items[name] = item
        if self.order is not None:
            ordered = sorted(self.items.items(), key=lambda kv: self.order(kv[1]))
            self.items.clear()
            self.items.update(ordered)
        return item

    def remove(self, name: str) -> None:
        if name not in self.built_in:
            self.items.pop(name, None)

    @contextlib.contextmanager
    def scoped(self, items: Iterable[T], add: Callable[[T], T] | None = None) -> Iterator[None]:
        """`items` added (by `add`: the module's own register) while the block runs, then removed;
        where one is refused, those added before it are removed."""
        added = []
        try:
            for item in items:
                added.append((add or self.add)(item))
            yield
        finally:
            for item in added:
                self.remove(self.name_of(item))
