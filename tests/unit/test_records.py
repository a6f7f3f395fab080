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
