"""memplan.records.record against dataclasses.dataclass: the same repr, equality and hash."""

import copy
import dataclasses

import pytest

from memplan.records import record


def _pair(frozen: bool, slots: bool, body: dict):
    """The same class made by ``dataclass`` and by ``record``."""
    made = []
    for deco in (dataclasses.dataclass(frozen=frozen, slots=slots), record(frozen=frozen, slots=slots)):
        ns = {"__annotations__": {k: v[0] for k, v in body.items()}}
        ns.update({k: v[1] for k, v in body.items() if v[1] is not dataclasses.MISSING})
        made.append(deco(type("Rec", (), ns)))
    return made


BODIES = {
    "none": {},
    "one": {"a": (int, dataclasses.MISSING)},
    "three": {"a": (int, dataclasses.MISSING), "b": (str, "x"), "c": (tuple, ())},
    "options": {
        "a": (int, dataclasses.MISSING),
        "b": (str, dataclasses.field(default="x", repr=False)),
        "c": (int, dataclasses.field(default=0, compare=False)),
        "d": (int, dataclasses.field(default=0, hash=False)),
    },
}
VALUES = {"none": [{}], "one": [{"a": 1}, {"a": 2}], "three": [{"a": 1}, {"a": 1, "b": "y", "c": (1, "z")}],
          "options": [{"a": 1}, {"a": 1, "b": "q", "c": 5, "d": 7}, {"a": 1, "d": 7}]}  # fmt: skip


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("kind", list(BODIES))
def test_record_matches_dataclass(kind: str, frozen: bool, slots: bool) -> None:
    dc, rec = _pair(frozen, slots, BODIES[kind])
    dcs = [dc(**v) for v in VALUES[kind]]
    recs = [rec(**v) for v in VALUES[kind]]
    for i, (d, r) in enumerate(zip(dcs, recs, strict=True)):
        assert repr(r) == repr(d)
        for j, (d2, r2) in enumerate(zip(dcs, recs, strict=True)):
            assert (r == r2) is (d == d2), (i, j)
            assert (r != r2) is (d != d2), (i, j)
        assert r.__eq__(d) is NotImplemented and (r == d) is False
        if frozen:
            assert hash(r) == hash(d)
            assert _set_error(r) is _set_error(d) is not None  # FrozenInstanceError, or CPython's own
        else:
            with pytest.raises(TypeError):
                hash(r)
        assert dataclasses.asdict(r) == dataclasses.asdict(d)
        assert dataclasses.replace(r) == r
        assert copy.deepcopy(r) == r
    assert [f.name for f in dataclasses.fields(rec)] == [f.name for f in dataclasses.fields(dc)]


def _set_error(obj: object) -> type | None:
    try:
        obj.a = 3  # type: ignore[attr-defined]
    except Exception as err:  # noqa: BLE001 - the type raised is what is compared
        return type(err)
    return None


def test_own_methods_refused() -> None:
    class Own:
        a: int

        def __repr__(self) -> str:
            return "own"

    with pytest.raises(TypeError, match="__repr__"):
        record()(Own)


def _written(frozen: bool, slots: bool):
    """A class with its own ``__init__`` made by ``record``, and its ``dataclass`` twin."""

    class Own:
        a: int
        b: str = "x"
        c: list = dataclasses.field(default_factory=list, hash=False)

        if frozen:

            def __init__(self, a: int, b: str = "x", c: list | None = None) -> None:
                object.__setattr__(self, "a", a)
                object.__setattr__(self, "b", b)
                object.__setattr__(self, "c", [] if c is None else c)
        else:

            def __init__(self, a: int, b: str = "x", c: list | None = None) -> None:
                self.a, self.b, self.c = a, b, [] if c is None else c

    ns = {"__annotations__": {"a": int, "b": str, "c": list}, "b": "x"}
    ns["c"] = dataclasses.field(default_factory=list, hash=False)
    twin = dataclasses.dataclass(frozen=frozen, slots=slots)(type("Own", (), ns))
    Own.__qualname__ = "Own"
    return record(frozen=frozen, slots=slots)(Own), twin


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("frozen", [True, False])
def test_written_init_matches_dataclass(frozen: bool, slots: bool) -> None:
    rec, dc = _written(frozen, slots)
    for args, kwargs in (((1,), {}), ((2, "y"), {}), ((3,), {"c": [1]})):
        r, d = rec(*args, **kwargs), dc(*args, **kwargs)
        assert repr(r) == repr(d) and dataclasses.asdict(r) == dataclasses.asdict(d)
        assert dataclasses.replace(r, b="z").b == "z"
        assert copy.deepcopy(r) == r and copy.copy(r) == r  # through __getstate__ and __setstate__ when slotted
        assert rec(1).c is not rec(1).c  # the factory called for each instance
        assert dataclasses.is_dataclass(r) and rec.__dataclass_params__.frozen is frozen
        if frozen:
            assert hash(r) == hash(d)
            assert _set_error(r) is _set_error(d) is dataclasses.FrozenInstanceError
            with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'a'"):
                del r.a
        else:
            r.a = 5
            assert r.a == 5
    assert ("__dict__" in rec.__dict__) is not slots


@pytest.mark.parametrize(
    "init",
    [
        "def __init__(self, b, a): ...",  # the order
        "def __init__(self, a, b): ...",  # a default left out
        "def __init__(self, a, b='y'): ...",  # another default
        "def __init__(self, a, b=0): ...",  # a default of another type
        "def __init__(self, a, *, b='x'): ...",  # keyword-only
        "def __init__(self, a): ...",  # a field left out
    ],
)
def test_written_init_checked(init: str) -> None:
    ns: dict = {"__annotations__": {"a": int, "b": str}, "b": "x"}
    exec(init, ns)  # noqa: S102 - the test's own source
    with pytest.raises(TypeError, match="does not take the fields"):
        record()(type("Bad", (), ns))


def _written_records() -> list[type]:
    from memplan.costmodel import activations, layout, lora, precision, runtimes, time
    from memplan.costmodel.timeline import events, trainer_model
    from memplan.specs import detect, resolve

    modules = (activations, layout, lora, precision, runtimes, time, events, trainer_model, detect, resolve)
    found = [
        c
        for m in modules
        for c in vars(m).values()
        if isinstance(c, type) and c.__module__ == m.__name__ and dataclasses.is_dataclass(c) and "__init__" in vars(c)
    ]
    assert len(found) == 14  # the classes below: a new written-out one is added to the list
    return found


@pytest.mark.parametrize("cls", _written_records(), ids=lambda c: c.__qualname__)
def test_memplan_written_inits_set_every_field(cls: type) -> None:
    """Each of memplan's written-out ``__init__``s sets every field to what it is given, and the
    defaults (a new object from each factory) to what ``dataclass`` would."""
    fields = dataclasses.fields(cls)
    given = {f.name: object() for f in fields}
    obj = cls(**given)
    assert all(getattr(obj, f.name) is given[f.name] for f in fields)
    required = {f.name: given[f.name] for f in fields if f.default is f.default_factory is dataclasses.MISSING}
    a, b = cls(**required), cls(**required)
    for f in fields:
        if f.default_factory is not dataclasses.MISSING:
            assert getattr(a, f.name) == f.default_factory() and getattr(a, f.name) is not getattr(b, f.name)
        elif f.default is not dataclasses.MISSING:
            assert getattr(a, f.name) is f.default
