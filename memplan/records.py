"""Dataclasses whose methods are closures, not generated source.

``dataclasses.dataclass`` writes each method it adds as Python source and ``exec``s it
(CPython 3.11's ``dataclasses._create_fn``): parsing and compiling that source costs ~1,400
instructions a character, paid at every import. ``memplan estimate`` imports ~25 dataclasses, whose
methods were ~49,000 characters of such source, ~75 M instructions of a cold estimate (callgrind:
``PyRun_StringFlags`` with memplan's modules imported against the same stack without them).
:func:`record` lets ``dataclass`` collect the fields (``dataclasses.fields``, ``replace`` and
``asdict`` work) but generate nothing, and makes each method as a closure over the field names. Each
does what the generated one does: ``__init__`` takes the fields in order, positional or by keyword,
with their defaults and default factories; ``__repr__`` returns the same text (``Name(a=1, b='x')``,
the fields with ``repr=True``); ``__eq__`` compares the same tuples for an object of the same class
(``NotImplemented`` for another); ``__hash__`` hashes the same tuple (the fields compared, or those
with ``hash=True``), ``None`` for a mutable class (unhashable, as ``eq=True`` makes it); a frozen
class's ``__setattr__`` and ``__delattr__`` raise ``FrozenInstanceError`` for a field, and a slotted
one's ``__getstate__`` and ``__setstate__`` let copies and pickles restore it. The class's
``__dataclass_params__`` says ``init=False, repr=False, eq=False, frozen=False``, the methods being
this module's. What differs: the ``TypeError`` of a wrong call names ``__init__()``, not the class's
``__init__()``; ``inspect.signature`` of the class reads ``(*args, **kwargs)``; the ``__repr__`` does not
guard against a record that contains itself (none does: their fields are numbers, strings, tuples and
other records); a slotted frozen class's ``__setattr__`` compares with the class itself (CPython
3.11's compares with the class before ``slots`` rebuilt it, and so raises a ``TypeError`` for a name
that is not a field). The instances are made ~2 us slower than by a generated ``__init__``: the
estimate makes ~100 (``AllocatorStats`` 94 of them), the search ~50 a pass over its grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

T = TypeVar("T")


def record(*, frozen: bool = True, slots: bool = False) -> Callable[[type[T]], type[T]]:
    """``@dataclass(frozen=frozen, slots=slots)`` with every method it would generate made as a
    closure (the module docstring)."""

    def wrap(cls: type[T]) -> type[T]:
        own = {"__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__"} & set(cls.__dict__)
        if own:  # dataclass keeps a class's own methods: so would this, but say so rather than guess
            raise TypeError(f"{cls.__name__} defines {', '.join(sorted(own))}: use dataclasses.dataclass")
        cls = dataclasses.dataclass(init=False, repr=False, eq=False, slots=slots)(cls)
        fields = dataclasses.fields(cls)
        names = tuple(f.name for f in fields)
        _method(cls, _init(fields))
        _method(cls, _repr([f.name for f in fields if f.repr]))
        _method(cls, _eq(_getter([f.name for f in fields if f.compare])))
        if frozen:
            hashed = [f.name for f in fields if (f.compare if f.hash is None else f.hash)]
            _method(cls, _hash(_getter(hashed)))
            for fn in _frozen(cls, names):
                _method(cls, fn)
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


def _init(fields: tuple[dataclasses.Field, ...]) -> Callable[..., None]:
    """The generated ``__init__``: the fields in order, positional or by keyword, each given, else its
    default, else its ``default_factory()``; set with ``object.__setattr__`` (as a frozen class's is)."""
    names = tuple(f.name for f in fields)
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    factories = {f.name: f.default_factory for f in fields if f.default_factory is not dataclasses.MISSING}
    count = len(names)
    put = object.__setattr__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > count:
            raise TypeError(f"__init__() takes {count + 1} positional arguments but {len(args) + 1} were given")
        for name, value in zip(names, args, strict=False):  # the fields given by position
            put(self, name, value)
        for name in names[len(args) :]:
            if name in kwargs:
                value = kwargs.pop(name)
            elif name in defaults:
                value = defaults[name]
            elif name in factories:
                value = factories[name]()
            else:
                raise TypeError(f"__init__() missing 1 required positional argument: {name!r}")
            put(self, name, value)
        if kwargs:
            name = next(iter(kwargs))
            why = "got multiple values for argument" if name in names else "got an unexpected keyword argument"
            raise TypeError(f"__init__() {why} {name!r}")

    return __init__


def _frozen(cls: type, names: tuple[str, ...]) -> list[Callable[..., Any]]:
    """A frozen dataclass's ``__setattr__`` and ``__delattr__`` (and, slotted, the ``__getstate__`` and
    ``__setstate__`` that copies and pickles restore it by): a field is never set or deleted after
    ``__init__``."""

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    if "__slots__" not in cls.__dict__:
        return [__setattr__, __delattr__]
    get = _getter(list(names))
    put = object.__setattr__

    def __getstate__(self: Any) -> list[Any]:
        return list(get(self))

    def __setstate__(self: Any, state: list[Any]) -> None:
        for name, value in zip(names, state, strict=True):
            put(self, name, value)

    return [__setattr__, __delattr__, __getstate__, __setstate__]


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
