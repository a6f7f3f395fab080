import sys
from pathlib import Path

# the accuracy harness (tests/accuracy/hf_steps.py) is imported by its tests and by
# benchmarks/accuracy_table.py
sys.path.insert(0, str(Path(__file__).parent / "accuracy"))
