"""Whether a Hugging Face model folder's weights are still their random initialisation.

One fact of the weights' values matters to memory: LLM.int8's outlier columns on CUDA (every input
column with some ``|x| >= 6.0`` is split off and kept with the graph, ``costmodel/timeline/int8.py``),
thousands per down projection over a random base and a few feature dimensions over a trained one
(``costmodel/timeline/int8_outliers.py``). A model built ``from_config`` and saved (what tests and
benchmarks without a hub load back) keeps its norms at their initial value: transformers'
``_init_weights`` fills an RMSNorm's weight with ones (``LlamaRMSNorm``) or, where the norm scales by
``1 + weight``, zeros (``Gemma3RMSNorm``); training moves every one of them. So a folder whose norm
weights are each one constant, 1 or 0, holds a random model, normal(0, ``initializer_range``).

The safetensors format (huggingface/safetensors, ``docs/source/index.mdx``, "Format"): 8 bytes, a
little-endian u64 N, then N bytes of JSON mapping each tensor's name to its ``dtype``, ``shape`` and
``data_offsets`` (begin, end) into the bytes after the header; a sharded checkpoint's
``model.safetensors.index.json`` maps each name to its file in ``weight_map``. Only the header and a few
norms' bytes are read, with the standard library: the estimate path imports nothing heavy.
"""

import json
import struct
from pathlib import Path
from typing import Any

# The bytes of one element at 1.0 (little-endian) per safetensors dtype; 0.0 is every byte zero.
_ONE = {"F32": b"\x00\x00\x80\x3f", "BF16": b"\x80\x3f", "F16": b"\x00\x3c", "F64": b"\x00" * 6 + b"\xf0\x3f"}
_NORMS_READ = 4  # the first layers' norms and the final one: a trained model moves every norm
_HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on the header's size (MAX_HEADER_SIZE)
DEFAULT_INIT_RANGE = 0.02  # transformers' PretrainedConfig initializer_range where a config gives none


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and the offset its tensors' bytes start at."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _HEADER_LIMIT:
            raise ValueError("header too large")
        return json.loads(f.read(n)), 8 + n


def _files(folder: Path) -> dict[str, Path]:
    """Each norm weight's name -> the file that holds it."""
    single = folder / "model.safetensors"
    if single.is_file():
        names = _header(single)[0]
        return {name: single for name in names if name.endswith("norm.weight")}
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return {}
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: folder / file for name, file in weight_map.items() if name.endswith("norm.weight")}


def _constant_init(path: Path, name: str) -> bool:
    """Whether tensor ``name`` of ``path`` is all ones or all zeros."""
    header, start = _header(path)
    entry = header[name]
    one = _ONE.get(entry["dtype"])
    begin, end = entry["data_offsets"]
    if one is None or end <= begin or (end - begin) % len(one):
        return False
    with path.open("rb") as f:
        f.seek(start + begin)
        data = f.read(end - begin)
    count = len(data) // len(one)
    return data == one * count or data == bytes(len(data))


def random_init(folder: Path, config: dict[str, Any]) -> float | None:
    """``config``'s ``initializer_range`` when ``folder``'s checkpoint holds a random model (its norm
    weights, up to four of them, each all ones or all zeros), else None: trained weights, or nothing
    readable to tell (no safetensors, an unreadable file: the weights are not an input of the estimate)."""
    try:
        files = _files(folder)
        names = sorted(files, key=lambda n: (not n.startswith("model.norm"), n))[:_NORMS_READ]
        if not names or not all(_constant_init(files[n], n) for n in names):
            return None
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return init_range(config.get("initializer_range"))


def init_range(std: Any) -> float:
    """A config's ``initializer_range`` (the std of the random normal weights), or transformers'
    default where it gives none usable."""
    return float(std) if isinstance(std, int | float) and 0 < std <= 1 else DEFAULT_INIT_RANGE
