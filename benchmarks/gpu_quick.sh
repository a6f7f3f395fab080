#!/usr/bin/env bash
# The GPU suite's --quick in one command on a lent GPU, install included, within 8 minutes
# (docs/gpu-suite.md). From the repository root, with the carried wheels in .whl/ (pydantic and
# what it needs: the device image lacks them):
#
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_quick.sh --out "$OUT/accuracy-gpu.md"
#
# It installs the wheels into /tmp/site (on PYTHONPATH for the suite and its children), then memplan
# itself (`pip install -e .`: the bundled profiles import as memplan.profiles only when installed),
# and runs `benchmarks/gpu_suite.py --quick` with the seconds the install took, so the suite keeps
# the whole command inside --time-limit (480 s). A first argument --full runs the full suite instead,
# as far as 480 s go (a rerun with the same state resumes it). Further arguments go to the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python=${PYTHON:-python3}
mode=--quick
if [[ "${1:-}" == --full ]]; then
    mode=
    shift
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
spent=$((SECONDS - start))
echo "gpu_quick: installed in ${spent} s" >&2
exec "$python" benchmarks/gpu_suite.py $mode --time-limit 480 --spent "$spent" "$@"
