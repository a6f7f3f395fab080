"""memplan.records.record against dataclasses.dataclass: the same repr, equality and hash."""

import copy
import dataclasses
import pickle

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
    "factory": {"a": (list, dataclasses.field(default_factory=list)), "b": (int, 2)},
    "options": {
        "a": (int, dataclasses.MISSING),
        "b": (str, dataclasses.field(default="x", repr=False)),
        "c": (int, dataclasses.field(default=0, compare=False)),
        "d": (int, dataclasses.field(default=0, hash=False)),
    },
}
VALUES = {
    "none": [{}],
    "factory": [{}, {"b": 3}, {"a": [1]}],
    "one": [{"a": 1}, {"a": 2}],
    "three": [{"a": 1}, {"a": 1, "b": "y", "c": (1, "z")}],
    "options": [{"a": 1}, {"a": 1, "b": "q", "c": 5, "d": 7}, {"a": 1, "d": 7}],
}


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
            assert _hash_or_error(r) == _hash_or_error(d)
            assert _set_error(r) is dataclasses.FrozenInstanceError
        else:
            with pytest.raises(TypeError):
                hash(r)
        assert dataclasses.asdict(r) == dataclasses.asdict(d)
        assert dataclasses.replace(r) == r
        assert copy.deepcopy(r) == r
    assert [f.name for f in dataclasses.fields(rec)] == [f.name for f in dataclasses.fields(dc)]
    first = VALUES[kind][-1]
    args = [getattr(dcs[-1], f.name) for f in dataclasses.fields(dc)]  # every field, by position
    assert rec(*args) == rec(**first) and repr(rec(*args)) == repr(dc(*args))
    for args, kwargs in [((0,) * 6, {}), ((), {"zz": 1}), ((1,), {next(iter(first), "zz"): 1})]:
        assert _call_error(rec, args, kwargs) is _call_error(dc, args, kwargs) is TypeError
    if kind == "one":
        assert _call_error(rec, (), {}) is _call_error(dc, (), {}) is TypeError  # a required field missing
    if kind == "factory":
        assert rec().a is not rec().a  # a new list each time


def _hash_or_error(obj: object) -> object:
    try:
        return hash(obj)
    except TypeError as err:  # a list among the fields: unhashable either way
        return str(err)


def _call_error(cls: type, args: tuple, kwargs: dict) -> type | None:
    try:
        cls(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the type raised is what is compared
        return type(err)
    return None


@record(slots=True)
class Point:
    x: int
    y: str = "y"


def test_frozen_slotted_record_pickles() -> None:
    p = Point(1)
    assert pickle.loads(pickle.dumps(p)) == p and copy.copy(p) == p and copy.deepcopy(p) == p
    with pytest.raises(dataclasses.FrozenInstanceError):
        del p.x
    assert dataclasses.replace(p, y="z") == Point(1, "z")


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
