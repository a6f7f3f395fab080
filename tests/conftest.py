import os
import sys
from pathlib import Path

from hypothesis import settings

# the accuracy harness (tests/accuracy/hf_steps.py) is imported by its tests and by
# benchmarks/accuracy_table.py
sys.path.insert(0, str(Path(__file__).parent / "accuracy"))

# CI explores the same examples every run; locally each run explores new ones
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
