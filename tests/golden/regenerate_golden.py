"""The golden exports of tests/golden/test_exports.py and the command that rewrites them.

The test only compares; this is the one place that writes the golden files, run by hand after a
reviewed change to an exporter:

    python tests/golden/regenerate_golden.py

It runs ``memplan export <plan>.yaml --to <target> -o <golden file>`` for every row of ``GOLDEN``
and prints the files it rewrote; ``git diff tests/golden/exports`` then shows what changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memplan.cli.app import run

HERE = Path(__file__).parent / "exports"
GOLDEN = [
    # plan, target, extra arguments, file
    ("llama3-8b-fsdp", "deepspeed", [], "llama3-8b-fsdp-deepspeed.json"),
    ("llama3-8b-fsdp", "accelerate", [], "llama3-8b-fsdp-accelerate.yaml"),
    ("llama3-8b-fsdp", "torchtitan", [], "llama3-8b-fsdp-torchtitan.py"),
    ("llama3-8b-fsdp", "torchtitan", ["--torchtitan-form", "toml"], "llama3-8b-fsdp-torchtitan.toml"),
    ("llama3-8b-fsdp", "fsdp2", [], "llama3-8b-fsdp-fsdp2.py"),
    ("llama3-70b-3d", "megatron", [], "llama3-70b-3d-megatron.sh"),
    ("llama3-70b-tp-pp-fsdp", "torchtitan", [], "llama3-70b-tp-pp-fsdp-torchtitan.py"),
    ("llama3-70b-tp-pp-fsdp", "torchtitan", ["--torchtitan-form", "toml"], "llama3-70b-tp-pp-fsdp-torchtitan.toml"),
]


def export(plan: str, target: str, extra: list[str], out: Path) -> int:
    """``memplan export`` of a plan under tests/golden/exports/plans to ``out``; its exit code."""
    return run(["export", str(HERE / "plans" / f"{plan}.yaml"), "--to", target, *extra, "-o", str(out)])


def main() -> int:
    for plan, target, extra, name in GOLDEN:
        code = export(plan, target, extra, HERE / name)
        if code != 0:
            return code
        print(HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
