"""``python -m pipeline.config``: params.yaml as conf/ composes it (``load.main``)."""
import sys

from pipeline.config.load import main

USAGE = """\
usage: python -m pipeline.config [--check | --write] [OVERRIDE ...]

Composes conf/ plus the overrides (Hydra grammar: key=value, group=option, +key=value) into
the content of params.yaml, as `dvc exp run -S ...` writes it, and validates it.
  (no flag)  print it
  --check    compare it with params.yaml: exit 0 when equal, 1 when not
  --write    write it to params.yaml (after editing conf/; `dvc repro` runs that file)
Examples: python -m pipeline.config --write
          python -m pipeline.config model=cnn optimizer.lr=1e-2
Exit codes: 2 bad configuration (one line naming the key), 1 params.yaml differs (--check).
"""
FLAGS = ("--check", "--write")

args = sys.argv[1:]
if any(a in ("-h", "--help") for a in args):
    print(USAGE, end="")
    sys.exit(0)
unknown = [a for a in args if a.startswith("-") and a not in FLAGS]  # an override never starts with '-'
if unknown:  # not left to the override parser, whose "cannot parse the overrides" hides that it is a flag
    print(f"config error: unrecognized option {unknown[0]}; the options are --check, --write, --help", file=sys.stderr)
    sys.exit(2)
sys.exit(main())
