"""One helper for every registry: entries by name, one error text for a name nobody registered."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from runtime.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry (a class, a function, a preset). ``what`` names the concept in errors ("weight method")."""

    def __init__(self, what: str):
        self.what = what
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        """The entry named ``name``, or a ``UserError`` listing the names there are."""
        try:
            return self._entries[name]
        except KeyError:
            raise UserError(f"unknown {self.what} {name!r}: pick one of {', '.join(self._entries) or '(none registered)'}") from None

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):
        return self._entries.items()

    def values(self):
        return self._entries.values()
