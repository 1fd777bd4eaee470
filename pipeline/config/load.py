"""How a stage gets its configuration.

Where it comes from (``load``):

1. Overrides on the command line (``python -m pipeline.train optimizer.lr=3e-3``):
   Hydra composes ``conf/`` plus the overrides (Hydra's override grammar). A hand run.
2. No overrides and ``params.yaml`` exists: ``params.yaml`` as it is. This is how DVC
   runs every stage (``dvc exp run`` recomposes ``params.yaml`` from ``conf/`` and its
   ``-S`` overrides first; ``dvc repro`` uses the committed file), and a hand run with no
   overrides reproduces exactly what DVC would run.
3. Neither: Hydra composes ``conf/``.

Whatever the source, ``validate`` merges it into the schema (pipeline/config/schema.py:
unknown keys and wrong types are rejected), builds the typed ``Config`` (each section's
checks run), then checks the engine blocks' ``_target_`` nodes, all before any work.
Every error is a ``ConfigError`` naming the key and what is allowed.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import messages
from pipeline.config.schema import FieldError, block_nodes, check_block, config_class, first_line, section_paths
from pipeline.errors import ConfigError
from pipeline.paths import project_root

CONFIG_NAME = "config"


def load(argv: Sequence[str] | None = None, *, root: Path | None = None):
    """The validated, typed configuration for a stage; see the module docstring."""
    from omegaconf import OmegaConf

    root = Path(root) if root is not None else project_root()
    overrides = list(sys.argv[1:] if argv is None else argv)
    params = root / "params.yaml"
    if overrides or not params.is_file():
        raw = compose(overrides, root=root)
    else:
        try:
            raw = OmegaConf.load(params)
        except Exception as exc:  # yaml.YAMLError and OmegaConf's own
            raise ConfigError(f"{params}: not readable YAML ({first_line(exc)}); regenerate it with `dvc exp run`") from None
    return validate(raw)


def source_of(argv: Sequence[str] | None = None, *, root: Path | None = None) -> str:
    """Where ``load(argv)`` takes the configuration from, for logs and tags."""
    root = Path(root) if root is not None else project_root()
    overrides = list(sys.argv[1:] if argv is None else argv)
    if overrides:
        return "conf/ + overrides: " + " ".join(overrides)
    return "params.yaml" if (root / "params.yaml").is_file() else "conf/"


def compose(overrides: Sequence[str] = (), *, root: Path | None = None):
    """Compose ``conf/`` with Hydra overrides, as DVC does for ``params.yaml`` (resolved)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    root = Path(root) if root is not None else project_root()
    conf = root / "conf"
    if not (conf / f"{CONFIG_NAME}.yaml").is_file():
        raise ConfigError(f"{conf / (CONFIG_NAME + '.yaml')}: missing; run from the repository or set ODT_PROJECT_ROOT")
    try:
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise messages.compose_error(exc, overrides, conf, config_class()) from None
    return cfg


def compose_yaml(overrides: Sequence[str] = (), *, root: Path | None = None) -> str:
    """``params.yaml`` exactly as ``dvc exp run`` writes it for these overrides."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(compose(overrides, root=root))


def group_options(root: Path | None = None) -> dict[str, list[str]]:
    """Config group -> its options (file stems), from ``conf/``."""
    conf = (Path(root) if root is not None else project_root()) / "conf"
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(conf.iterdir())
        if d.is_dir() and any(d.glob("*.yaml"))
    }


def validate(raw) -> Any:
    """``raw`` (a DictConfig) as the typed ``Config``: schema types, each section's checks,
    then the engine blocks' nodes (allowed ``_target_``, its arguments, their values)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(raw, DictConfig):
        raise ConfigError(f"the configuration must be a mapping of sections, got {type(raw).__name__}")
    schema = config_class()
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except FieldError as exc:  # a section's check: it knows its field, the schema knows where the section sits
        where = {tp: path + "." for path, tp in section_paths(schema)}.get(exc.owner, "")
        raise ConfigError(f"{where}{exc}") from None
    except OmegaConfBaseException as exc:
        raise messages.schema_error(exc, schema) from None
    for key, node, blocks in block_nodes(cfg):
        check_block(key, node, blocks)
    return cfg


def to_container(cfg) -> dict:
    """Plain dict (enums as strings) for JSON files and MLflow params."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.config [--check | --write] [overrides...]``: print, check or write params.yaml."""
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    write = "--write" in args
    overrides = [a for a in args if a not in ("--check", "--write")]
    try:
        text = compose_yaml(overrides)
        validate(compose(overrides))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return exc.exit_code
    params = project_root() / "params.yaml"
    if check:
        same = params.is_file() and params.read_text(encoding="utf-8") == text
        print("params.yaml matches conf/" if same else "params.yaml differs from conf/: run `python -m pipeline.config --write`")
        return 0 if same else 1
    if write:
        from pipeline.io import atomic_write_text

        atomic_write_text(params, text)
        print(f"wrote {params}")
        return 0
    sys.stdout.write(text)
    return 0
