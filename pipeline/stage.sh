#!/bin/sh
# DVC's command for every stage: `sh pipeline/stage.sh <stage>` is `python -m pipeline.<stage>`
# run by the project's interpreter, found without relying on `python` being on PATH (the
# README runs `.venv/bin/dvc repro` without activating the venv; cron's PATH is minimal):
# $ODT_PYTHON, the active virtualenv, the repository's .venv ($DVC_ROOT is the original
# repository, also for queued experiments run in a temporary copy), ./.venv, then python3.
stage="$1"
for py in "${ODT_PYTHON:-}" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "${DVC_ROOT:+$DVC_ROOT/.venv/bin/python}" ./.venv/bin/python; do
    if [ -n "$py" ] && [ -x "$py" ]; then
        exec "$py" -m "pipeline.$stage"
    fi
done
if command -v python3 >/dev/null 2>&1; then
    exec python3 -m "pipeline.$stage"
fi
exec python -m "pipeline.$stage"
