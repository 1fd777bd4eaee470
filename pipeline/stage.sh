#!/bin/sh
# DVC's command for every stage: `sh pipeline/stage.sh <stage> [OVERRIDE ...]` is
# `python -m pipeline.<stage> [OVERRIDE ...]` run by the project's interpreter, found without
# relying on `python` being on PATH (the README runs `.venv/bin/dvc repro` without activating
# the venv; cron's PATH is minimal): $ODT_PYTHON, the active virtualenv, the repository's
# .venv ($DVC_ROOT is the original repository, also for queued experiments run in a temporary
# copy), ./.venv, then python3.
#
# The same bytes on any x86-64 machine (README, "Reproducibility"). Two libraries choose their
# arithmetic by the CPU they find, and either choice changes the last bits of sums, so the
# pretrained weights, and everything after them, would differ between machines:
# - OpenBLAS (numpy's BLAS, built DYNAMIC_ARCH) picks its kernels by CPU type (SkylakeX on
#   AVX-512, Haswell on AVX2, ...). OPENBLAS_CORETYPE=Nehalem pins the kernels for x86-64-v2,
#   the baseline numpy's wheels require, so every x86-64 CPU numpy runs on can run them; one
#   thread (a stage raises it with device.threads, which splits work, not sums).
# - numpy dispatches its own loops (exp, log, sums, ...) to AVX2 or AVX-512 versions at
#   import. NPY_DISABLE_CPU_FEATURES turns every dispatch target off, leaving its baseline
#   loops: numpy 2.4's names and the older releases' (a release ignores the names it does not
#   dispatch, with an ImportWarning, which Python hides by default).
# Set before Python starts: both are read once, when numpy loads.
stage="$1"
shift
if [ "$(uname -m)" = "x86_64" ]; then
    export OPENBLAS_CORETYPE=Nehalem OPENBLAS_NUM_THREADS=1
    export NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX AVX2 FMA3 F16C AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL"
fi
for py in "${ODT_PYTHON:-}" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "${DVC_ROOT:+$DVC_ROOT/.venv/bin/python}" ./.venv/bin/python; do
    if [ -n "$py" ] && [ -x "$py" ]; then
        exec "$py" -m "pipeline.$stage" "$@"
    fi
done
if command -v python3 >/dev/null 2>&1; then
    exec python3 -m "pipeline.$stage" "$@"
fi
exec python -m "pipeline.$stage" "$@"
