"""Load specs from bundled profiles, memplan YAML files and Hugging Face config.json files.

Every failure becomes a :class:`MemplanError` naming the file, the field path and the reason.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

import memplan.profiles
from memplan.errors import MemplanError
from memplan.specs.hardware import GPUSpec
from memplan.specs.model import ModelSpec

M = TypeVar("M", bound=BaseModel)
# pydantic's errors for a value of the wrong type: the message then says what was given
_TYPE_ERRORS = {
    "int_type", "int_parsing", "int_from_float", "bool_type", "bool_parsing", "float_type", "string_type", "dict_type",
    "list_type", "tuple_type",
}  # fmt: skip
NAME_LIMIT = 120  # characters of a file name or value a message shows (the rest elided)
# compiled at the first error that names a field (re's cache), not at every import (~1 M instructions)
_FIELD_PREFIX = r"^(?P<field>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*): "


def is_hf_config(data: dict) -> bool:
    """``specs.hf.is_hf_config``, without importing the readers: a dict looks like a config.json
    when it names architectures or a model_type."""
    return "architectures" in data or "model_type" in data


def _profiles_dir(kind: str) -> Path:
    # the package's folder, as importlib.resources.files would give it (without importing
    # importlib.resources and zipfile on the estimate path); the profiles are plain files
    return Path(next(iter(memplan.profiles.__path__))) / kind


def profile_names(kind: str) -> list[str]:
    """Names of the bundled profiles of one kind ("models" or "gpus")."""
    return sorted(p.stem for p in _profiles_dir(kind).glob("*.yaml"))


def validation_error(exc: ValidationError, source: str, prefix: str = "") -> MemplanError:
    """The first pydantic error as one MemplanError: source, dotted field path, message."""
    err = exc.errors()[0]
    # drop pydantic's own tags ("[key]" for a bad dict key, "function-after[...]") from the path
    loc = ".".join(str(part) for part in err["loc"] if not str(part).startswith(("function-", "[")))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        # a model validator names the field it blames as a prefix: "offload_params: needs zero: 3"
        named = re.match(_FIELD_PREFIX, msg)
        if named:
            loc = ".".join(p for p in (loc, named["field"]) if p)
            msg = msg[named.end() :]
    field = ".".join(p for p in (prefix, loc) if p) or None
    if err["type"] in _TYPE_ERRORS:
        msg = f"{msg}, got {describe_value(err.get('input'))}"
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif err["type"] == "missing":
        msg = "required field is missing"
    return MemplanError(msg, source=source, field=field)


def validate(cls: type[M], data: Any, source: str, prefix: str = "") -> M:
    """``cls.model_validate(data)`` with errors turned into a MemplanError."""
    if not isinstance(data, dict):
        raise MemplanError(
            f"expected a mapping of fields, got {describe_value(data)}", source=source, field=prefix or None
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, source, prefix) from exc


def short(text: object, limit: int = NAME_LIMIT) -> str:
    """``text`` cut to ``limit`` characters around an ellipsis (its start and its end kept), so that
    a message never echoes a 100,000-character file name whole."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = (limit - 1) * 2 // 3
    return f"{text[:head]}…{text[len(text) - (limit - 1 - head) :]}"


def describe_value(value: object) -> str:
    """What a value read from a file is, for an error: ``nothing (the file or section is empty)``,
    ``a list``, ``a string ('abc')``, ``a boolean (true)``."""
    if value is None:
        return "nothing (empty)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    kinds = {list: "a list", str: "a string", int: "an integer", float: "a number", dict: "a mapping"}
    kind = next((name for t, name in kinds.items() if isinstance(value, t)), type(value).__name__)
    return f"{kind} ({short(repr(value), 40)})" if isinstance(value, str | int | float) else kind


class _UniqueKeys:
    """A PyYAML safe loader refusing a key given twice in one mapping (PyYAML keeps the last one
    silently; YAML 1.2 says keys are unique). Merge keys (``<<``) still override as YAML says."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: PyYAML's own error says so
                continue
            if duplicate:
                line = key_node.start_mark.line + 1
                raise _DuplicateKey(f"duplicate key {short(repr(key), 60)} at line {line} (each key once)")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _UniqueKeyLoader(_UniqueKeys, yaml.SafeLoader):
    """For users' files: the pure-Python parser's messages say best what is wrong where."""


# For the bundled profiles (known to parse): libyaml's parser where PyYAML was built with it,
# several times faster on the estimate path; its error messages differ, which no user sees here
_BundledLoader = type("_BundledLoader", (_UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)), {})


class _DuplicateKey(Exception):
    pass


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``' object hook refusing a key given twice (json keeps the last one silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {short(repr(key), 60)} (each key once)")
        out[key] = value
    return out


def read_data(path: Path, bundled: bool = False) -> Any:
    """Parse a YAML or JSON file; a missing, binary, malformed file, or one that gives a key twice,
    is a MemplanError (the file named, cut to a readable length). ``bundled``: one of memplan's
    profiles, parsed with libyaml when PyYAML has it."""
    source = short(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise MemplanError("no such file", source=source) from None
    except IsADirectoryError:
        raise MemplanError("cannot read file: it is a directory", source=source) from None
    except PermissionError:
        raise MemplanError("cannot read file (permission denied)", source=source) from None
    except OSError as exc:  # a name too long, a loop of links, ...
        raise MemplanError(f"cannot read file ({exc.strerror or exc.__class__.__name__})", source=source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MemplanError(
            f"not a text file (byte {raw[exc.start]:#04x} at offset {exc.start} is not UTF-8): expected YAML or JSON",
            source=source,
        ) from None
    if "\0" in text:
        raise MemplanError("not a text file (it holds NUL bytes): expected YAML or JSON", source=source)
    if not text.strip():
        raise MemplanError("the file is empty: expected a mapping of fields", source=source)
    try:
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_json_object)
        return yaml.load(text, Loader=_BundledLoader if bundled else _UniqueKeyLoader)  # noqa: S506 - safe loaders
    except _DuplicateKey as exc:
        raise MemplanError(str(exc), source=source) from None
    except json.JSONDecodeError as exc:
        raise MemplanError(
            f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=source
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise MemplanError(f"malformed YAML{where}: {problem}", source=source) from None


def model_from_data(data: Any, source: str, default_name: str) -> ModelSpec:
    """A ModelSpec from a memplan model mapping or a Hugging Face config.json mapping."""
    if isinstance(data, dict) and is_hf_config(data):
        from memplan.specs.hf import READERS, hf_architecture, hf_key, hf_model_fields

        try:
            arch = hf_architecture(data)
        except KeyError as exc:
            raise MemplanError(f"unknown {exc.args[0]}", source=source, field="model_type") from None
        if arch not in READERS:
            supported = ", ".join(READERS)
            raise MemplanError(
                f"unsupported architecture {arch!r} (supported: {supported})", source=source, field="architectures"
            )
        try:
            fields = hf_model_fields(data)
            fields.setdefault("name", data.get("_name_or_path") or default_name)
            # a reader's note (a multimodal config counted for its text model only) follows the file name
            fields["source"] = f"{source} ({fields['source']})" if fields.get("source") else source
            return validate(ModelSpec, fields, source)
        except KeyError as exc:
            raise MemplanError(f"required field for {arch} is missing", source=source, field=str(exc.args[0])) from None
        except ValidationError as exc:  # a reader builds the MoESpec itself
            err = validation_error(exc, source, "moe")
            raise MemplanError(err.reason, source=source, field=hf_key(arch, err.field or "")) from None
        except MemplanError as err:
            raise MemplanError(err.reason, source=source, field=err.field and hf_key(arch, err.field)) from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise MemplanError(f"unreadable value ({' '.join(str(exc).split())})", source=source) from None
    if isinstance(data, dict):
        data = {"name": default_name, **data}
    return validate(ModelSpec, data, source)


def _is(path: Path, kind: str) -> bool:
    """``path.is_dir()`` / ``is_file()`` / ``exists()``, False for a name the OS refuses (too long)."""
    try:
        return getattr(path, kind)()
    except (OSError, ValueError):
        return False


def load_model(ref: str) -> ModelSpec:
    """A model from a bundled profile name, a memplan YAML file or a HF config.json."""
    path = Path(ref)
    if _is(path, "is_dir") and _is(path / "config.json", "is_file"):  # a Hugging Face model folder
        path = path / "config.json"
    if path.suffix in (".yaml", ".yml", ".json") or _is(path, "is_file"):
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        data = read_data(path)
        spec = model_from_data(data, short(path), name)
        if path.name == "config.json" and isinstance(data, dict) and is_hf_config(data):
            from memplan.specs.checkpoint import random_init  # a model folder's weights, read only here

            std = random_init(path.parent, data)
            if std is not None:
                spec = spec.model_copy(update={"random_init": std})
        return spec
    profile = _profiles_dir("models") / f"{ref}.yaml"
    if "/" not in ref and _is(profile, "exists"):
        return model_from_data(read_data(profile, bundled=True), ref, ref)
    raise MemplanError(
        f"no such file or bundled model profile (bundled: {', '.join(profile_names('models'))})", source=short(ref)
    )


def load_gpu(ref: str) -> GPUSpec:
    """A GPU from a bundled profile name or a YAML file."""
    path, bundled = Path(ref), False
    if not (path.suffix in (".yaml", ".yml", ".json") or _is(path, "exists")):
        path, bundled = _profiles_dir("gpus") / f"{ref.lower()}.yaml", True
        if "/" in ref or not _is(path, "exists"):
            # no source: the caller knows whether the name came from --gpu or a plan file
            names = ", ".join(profile_names("gpus"))
            raise MemplanError(f"unknown GPU {short(repr(ref), 60)} (bundled: {names})") from None
    return validate(GPUSpec, read_data(path, bundled), short(path))
