"""Dataclasses whose ``__repr__``, ``__eq__`` and ``__hash__`` are closures, not generated source.

``dataclasses.dataclass`` writes each method it adds as Python source and ``exec``s it
(CPython 3.11's ``dataclasses._create_fn``): parsing and compiling that source costs ~1,400
instructions a character, paid at every import. ``memplan estimate`` imports ~25 dataclasses, whose
methods were ~49,000 characters of such source, ~75 M instructions of a cold estimate (callgrind:
``PyRun_StringFlags`` with memplan's modules imported against the same stack without them).
:func:`record` keeps ``dataclass`` for the ``__init__`` (its signature and defaults) and, for a
frozen class, ``__setattr__`` and ``__delattr__``; the three methods that only read the fields are
closures over an :func:`operator.attrgetter` of the field names, made without source. They return
what the generated ones return: ``__repr__`` the same text (``Name(a=1, b='x')``, the fields with
``repr=True``), ``__eq__`` the comparison of the same tuples for an object of the same class
(``NotImplemented`` for another), ``__hash__`` the hash of the same tuple (the fields compared, or
those with ``hash=True``), ``None`` for a mutable class (unhashable, as ``eq=True`` makes it).
The class stays a dataclass (``dataclasses.fields``, ``replace`` and ``asdict`` work);
its ``__dataclass_params__`` says ``repr=False, eq=False``, the methods being this module's. Unlike
the generated ``__repr__``, the closure does not guard against a record that contains itself
(none does: their fields are numbers, strings, tuples and other records).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

T = TypeVar("T")


def record(*, frozen: bool = True, slots: bool = False) -> Callable[[type[T]], type[T]]:
    """``@dataclass(frozen=frozen, slots=slots)``, with ``__repr__``, ``__eq__`` and ``__hash__``
    as closures (the module docstring)."""

    def wrap(cls: type[T]) -> type[T]:
        own = {"__repr__", "__eq__", "__hash__"} & set(cls.__dict__)
        if own:  # dataclass keeps a class's own methods: so would this, but say so rather than guess
            raise TypeError(f"{cls.__name__} defines {', '.join(sorted(own))}: use dataclasses.dataclass")
        cls = dataclasses.dataclass(frozen=frozen, slots=slots, repr=False, eq=False)(cls)
        fields = dataclasses.fields(cls)
        _method(cls, _repr([f.name for f in fields if f.repr]))
        _method(cls, _eq(_getter([f.name for f in fields if f.compare])))
        if frozen:
            hashed = [f.name for f in fields if (f.compare if f.hash is None else f.hash)]
            _method(cls, _hash(_getter(hashed)))
        else:
            cls.__hash__ = None  # type: ignore[assignment]
        return cls

    return wrap


def _method(cls: type, fn: Callable[..., Any]) -> None:
    fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
    setattr(cls, fn.__name__, fn)


def _getter(names: list[str]) -> Callable[[Any], tuple]:
    """The tuple of the named fields' values (``attrgetter`` of one name returns the value alone)."""
    if len(names) > 1:
        return attrgetter(*names)
    if names:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


def _repr(names: list[str]) -> Callable[[Any], str]:
    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{self.__class__.__qualname__}({inner})"

    return __repr__


def _eq(values: Callable[[Any], tuple]) -> Callable[[Any, Any], Any]:
    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented

    return __eq__


def _hash(values: Callable[[Any], tuple]) -> Callable[[Any], int]:
    def __hash__(self: Any) -> int:
        return hash(values(self))

    return __hash__
