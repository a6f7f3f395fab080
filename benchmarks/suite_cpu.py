"""Where the test suite's CPU time goes, from the lines ``MEMPLAN_TEST_CPU=path pytest ...`` wrote.

``tests/conftest.py`` appends ``seconds<TAB>node id`` per test to ``path.<worker>``; this sums them
per file and lists the costliest files and tests:
``python benchmarks/suite_cpu.py /tmp/cpu [--top 40]``.
"""

import argparse
import glob
from collections import defaultdict


def read(prefix: str) -> dict[str, float]:
    """Each test's CPU seconds, over every worker's file (``prefix.gw0``, ``prefix.main``...)."""
    seconds: dict[str, float] = {}
    for name in glob.glob(f"{prefix}.gw*") + glob.glob(f"{prefix}.main"):
        with open(name) as lines:
            for line in lines:
                value, node = line.rstrip("\n").split("\t", 1)
                seconds[node] = seconds.get(node, 0.0) + float(value)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prefix")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    seconds = read(args.prefix)
    per_file: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for node, value in seconds.items():
        per_file[node.split("::", 1)[0]] += value
        count[node.split("::", 1)[0]] += 1
    print(f"{len(seconds)} tests, {sum(seconds.values()):.1f} CPU s")
    for name, value in sorted(per_file.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{value:8.1f} s  {count[name]:4d} tests  {name}")
    print()
    for node, value in sorted(seconds.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{value:8.1f} s  {node}")


if __name__ == "__main__":
    main()
