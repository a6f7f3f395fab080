"""Dataclasses whose ``__repr__``, ``__eq__`` and ``__hash__`` are closures, not generated source.

``dataclasses.dataclass`` writes each method it adds as Python source and ``exec``s it
(CPython 3.11's ``dataclasses._create_fn``): parsing and compiling that source costs ~1,400
instructions a character, paid at every import. ``memplan estimate`` imports ~25 dataclasses, whose
methods were ~49,000 characters of such source, ~75 M instructions of a cold estimate (callgrind:
``PyRun_StringFlags`` with memplan's modules imported against the same stack without them).
:func:`record` keeps ``dataclass`` for the ``__init__`` (its signature and defaults) and, for a
frozen class, ``__setattr__`` and ``__delattr__``, unless the class writes its own ``__init__``
(compiled with its module and cached as bytecode: ~1,000-2,500 characters of source, ~1.5-3.5 M
instructions, a class no longer parsed at each import). Such an ``__init__`` takes the fields in
their order with the same defaults (``None`` for a default factory; checked when the class is
made) and sets each as the generated one would (``object.__setattr__`` for a frozen class); the
frozen methods are then closures too, and a slotted frozen class gets the ``__getstate__`` and
``__setstate__`` dataclass gives it. The three methods that only read the fields are
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
        written = "__init__" in cls.__dict__
        if written:  # nothing left for dataclass to write: the frozen methods are this module's
            cls = dataclasses.dataclass(init=False, slots=slots, repr=False, eq=False)(cls)
        else:
            cls = dataclasses.dataclass(frozen=frozen, slots=slots, repr=False, eq=False)(cls)
        fields = dataclasses.fields(cls)
        if written:
            _check_init(cls, fields)
        _method(cls, _repr([f.name for f in fields if f.repr]))
        _method(cls, _eq(_getter([f.name for f in fields if f.compare])))
        if frozen:
            hashed = [f.name for f in fields if (f.compare if f.hash is None else f.hash)]
            _method(cls, _hash(_getter(hashed)))
            if written:
                _frozen(cls, frozenset(f.name for f in fields), slots)
        else:
            cls.__hash__ = None  # type: ignore[assignment]
        return cls

    return wrap


def _check_init(cls: type, fields: tuple[dataclasses.Field, ...]) -> None:
    """A class's own ``__init__`` takes the fields ``dataclass`` would, in its order, with the same
    defaults (``None`` for a default factory, which the body calls): else ``TypeError`` at import."""
    init = cls.__init__  # type: ignore[misc]
    code = init.__code__
    names = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
    positional, defaults = names[: code.co_argcount - 1], init.__defaults__ or ()
    given = dict(zip(positional[len(positional) - len(defaults) :], defaults, strict=True))
    given.update(init.__kwdefaults__ or {})
    wanted = {
        f.name: None if f.default is dataclasses.MISSING else f.default
        for f in fields
        if f.init and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
    }
    kw_only = sum(1 for f in fields if f.init and f.kw_only)
    if (
        names != tuple(f.name for f in fields if f.init)
        or code.co_kwonlyargcount != kw_only
        or given.keys() != wanted.keys()
        or any(type(given[k]) is not type(v) or given[k] != v for k, v in wanted.items())
    ):
        raise TypeError(f"{cls.__qualname__}.__init__ does not take the fields and defaults dataclass would")


def _frozen(cls: type, names: frozenset[str], slots: bool) -> None:
    """What ``dataclass(frozen=True)`` adds, without source: ``__setattr__`` and ``__delattr__`` that
    refuse the class's fields (any attribute of the class itself) with ``FrozenInstanceError``, as
    ``dataclasses._frozen_get_del_attr``'s do; the frozen flag in ``__dataclass_params__`` (which
    ``dataclass`` reads when a subclass is made); and for a slotted class the ``__getstate__`` and
    ``__setstate__`` that ``dataclasses._add_slots`` gives a frozen one (pickling and ``copy``
    restore the fields with ``object.__setattr__``)."""

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    _method(cls, __setattr__)
    _method(cls, __delattr__)
    cls.__dataclass_params__.frozen = True  # type: ignore[attr-defined]
    if slots:
        cls.__getstate__ = _getstate  # type: ignore[attr-defined]
        cls.__setstate__ = _setstate  # type: ignore[attr-defined]


def _getstate(self: Any) -> list:
    return [getattr(self, f.name) for f in dataclasses.fields(self)]


def _setstate(self: Any, state: list) -> None:
    for f, value in zip(dataclasses.fields(self), state, strict=True):
        object.__setattr__(self, f.name, value)


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
