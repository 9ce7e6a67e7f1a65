#!/usr/bin/env bash
# Run the GPU test files on a machine with a CUDA device, from this checkout. Installs nothing: the
# interpreter must already have numpy, msgpack, trio, pytest and pytest-trio, plus torch with CUDA
# (and cupy for the cupy tests, ml_dtypes for bfloat16 on numpy). Without a device everything skips.
#
#   bash scripts/gpu_check.sh             # uses $PYTHON, else python, else python3
#   bash scripts/gpu_check.sh -k cupy     # extra arguments go to pytest
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"  # import pccl from this checkout

FILES=(
  tests/kernels/test_kernel_gpu.py
  tests/integration/test_gpu_collectives.py
  tests/integration/test_gpu_shared_state.py
  tests/blocking/test_gpu_blocking.py
  # the staging pipeline's logic on the fake device (no GPU needed; ~3 s): the GPU files above run the
  # same pipeline through pccl.collectives.staging.SynchronousDevice
  tests/collectives/test_staging.py
  tests/integration/test_staged_cluster.py
)

"$PY" - <<'EOF' || exit 2
import importlib, sys
print(f"python {sys.version.split()[0]} at {sys.executable}")
missing = []
for name in ("numpy", "msgpack", "trio", "pytest", "pytest_trio", "torch", "ml_dtypes", "cupy"):
    try:
        mod = importlib.import_module(name)
    except Exception as exc:
        missing.append(name)
        print(f"  {name:12s} MISSING ({type(exc).__name__})")
        continue
    print(f"  {name:12s} {getattr(mod, '__version__', '?')}")
import torch
print(f"torch CUDA: available={torch.cuda.is_available()} devices={torch.cuda.device_count()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
if "cupy" not in missing:
    import cupy
    try:
        print(f"cupy devices: {cupy.cuda.runtime.getDeviceCount()}")
    except Exception as exc:
        print(f"cupy cannot use a device: {exc}")
needed = {"numpy", "msgpack", "trio", "pytest", "pytest_trio", "torch"} & set(missing)
if needed:
    sys.exit(f"gpu_check: missing {sorted(needed)}; install them first (this script installs nothing)")
if not torch.cuda.is_available():
    print("gpu_check: WARNING: torch sees no CUDA device, the GPU tests will skip")
EOF

"$PY" -m pytest -q -x -rs "${FILES[@]}" -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 0 ]; then
  echo "gpu_check: PASSED (${FILES[*]})"
else
  echo "gpu_check: FAILED (pytest exit code $rc)"
fi
exit "$rc"
