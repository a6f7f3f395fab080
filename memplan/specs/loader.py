"""Load specs from bundled profiles, memplan YAML files and Hugging Face config.json files.

Every failure becomes a :class:`MemplanError` naming the file, the field path and the reason.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from memplan.errors import MemplanError
from memplan.specs.hardware import GPUSpec
from memplan.specs.hf import READERS, hf_architecture, hf_key, hf_model_fields, is_hf_config
from memplan.specs.model import ModelSpec

M = TypeVar("M", bound=BaseModel)
_FIELD_PREFIX = re.compile(r"^(?P<field>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*): ")


def _profiles_dir(kind: str) -> Path:
    return Path(str(resources.files("memplan.profiles") / kind))


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
        named = _FIELD_PREFIX.match(msg)
        if named:
            loc = ".".join(p for p in (loc, named["field"]) if p)
            msg = msg[named.end() :]
    field = ".".join(p for p in (prefix, loc) if p) or None
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif err["type"] == "missing":
        msg = "required field is missing"
    return MemplanError(msg, source=source, field=field)


def validate(cls: type[M], data: Any, source: str, prefix: str = "") -> M:
    """``cls.model_validate(data)`` with errors turned into a MemplanError."""
    if not isinstance(data, dict):
        raise MemplanError(
            f"expected a mapping of fields, got {type(data).__name__}", source=source, field=prefix or None
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, source, prefix) from exc


def read_data(path: Path) -> Any:
    """Parse a YAML or JSON file; a missing or malformed file is a MemplanError."""
    source = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MemplanError("no such file", source=source) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise MemplanError(f"cannot read file ({exc.__class__.__name__})", source=source) from None
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
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


def load_model(ref: str) -> ModelSpec:
    """A model from a bundled profile name, a memplan YAML file or a HF config.json."""
    path = Path(ref)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model folder
        path = path / "config.json"
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return model_from_data(read_data(path), str(path), name)
    profile = _profiles_dir("models") / f"{ref}.yaml"
    if profile.exists():
        return model_from_data(read_data(profile), ref, ref)
    raise MemplanError(
        f"no such file or bundled model profile (bundled: {', '.join(profile_names('models'))})", source=ref
    )


def load_gpu(ref: str) -> GPUSpec:
    """A GPU from a bundled profile name or a YAML file."""
    path = Path(ref)
    if not (path.suffix in (".yaml", ".yml", ".json") or path.exists()):
        path = _profiles_dir("gpus") / f"{ref.lower()}.yaml"
        if not path.exists():
            # no source: the caller knows whether the name came from --gpu or a plan file
            raise MemplanError(f"unknown GPU {ref!r} (bundled: {', '.join(profile_names('gpus'))})") from None
    return validate(GPUSpec, read_data(path), str(path))
