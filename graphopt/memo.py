"""A bounded cache keyed by object identity, for values derived from objects that are costly to hash.

Weights (numpy arrays) and rule patterns are shared between the many graph copies a search builds; hashing
their content again for every copy would dominate the search.  Keying by ``id()`` alone is unsafe (an id
is reused once its object dies) and unbounded (every temporary array would stay listed), so each entry
holds the object weakly, is returned only while that very object is alive, and the least recently used
entries go once ``maxsize`` is reached.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable, Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: OrderedDict[int, tuple[Callable[[], Any], V]] = OrderedDict()

    def get(self, obj: object) -> V | None:
        key = id(obj)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0]() is not obj:  # the object this entry was made for died and its id was reused
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, obj: object, value: V) -> V:
        try:
            ref: Callable[[], Any] = weakref.ref(obj)
        except TypeError:  # not weakly referenceable: hold it (the bound still limits memory)
            ref = lambda: obj  # noqa: E731
        self._entries[id(obj)] = (ref, value)
        self._entries.move_to_end(id(obj))
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)
