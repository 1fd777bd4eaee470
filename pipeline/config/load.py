"""How a stage gets its configuration.

Where it comes from (``load``):

1. No overrides and ``params.yaml`` exists: ``params.yaml`` as it is. This is how DVC
   runs every stage (``dvc exp run`` recomposes ``params.yaml`` from ``conf/`` and its
   ``-S`` overrides first; ``dvc repro`` uses the committed file), and a hand run with no
   overrides reproduces exactly what DVC would run.
2. Overrides on the command line (``python -m pipeline.train optimizer.lr=3e-3``) and
   ``params.yaml`` exists: what DVC would run plus the overrides. Hydra composes a primary
   config made of ``params.yaml`` (registered in Hydra's ConfigStore), so the overrides keep
   Hydra's grammar and errors. A group switch (``model=cnn``, ``tracking=disabled``) has no
   value in ``params.yaml`` to change: that group's section is composed from its option in
   ``conf/`` (``recomposed`` names it, and the stage says so in one line); every other
   value stays ``params.yaml``'s.
3. No ``params.yaml``: Hydra composes ``conf/`` plus the overrides.

Whatever the source, ``validate`` merges it into the schema (pipeline/config/schema.py:
unknown keys and wrong types are rejected), builds the typed ``Config`` (each section's
checks run), then checks the engine blocks' ``_target_`` nodes, all before any work.
Every error is a ``ConfigError`` naming the key and what is allowed.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import messages
from pipeline.config.messages import did_you_mean, unknown_block_key
from pipeline.config.schema import Blocks, FieldError, arguments, block_nodes, config_class, first_line, section_paths, show
from pipeline.errors import ConfigError
from pipeline.paths import project_root

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONFIG_NAME = "config"
PARAMS_PRIMARY = "params_yaml"  # params.yaml as a primary config in Hydra's ConfigStore


def load(argv: Sequence[str] | None = None, *, root: Path | None = None):
    """The validated, typed configuration for a stage; see the module docstring."""
    root = Path(root) if root is not None else project_root()
    overrides = list(sys.argv[1:] if argv is None else argv)
    params = root / "params.yaml"
    if not params.is_file():
        raw = compose(overrides, root=root)
    elif not overrides:
        raw = read_params(params)
    else:
        raw = compose(overrides, root=root, base=read_params(params))
    return validate(raw)


def read_params(params: Path):
    from omegaconf import DictConfig, OmegaConf

    try:
        raw = OmegaConf.load(params)
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own
        raise ConfigError(f"{params}: not readable YAML ({first_line(exc)}); regenerate it with `dvc exp run`") from None
    if not isinstance(raw, DictConfig) or not raw:
        raise ConfigError(f"{params}: empty or not a mapping of sections; regenerate it with `python -m pipeline.config --write`")
    return raw


def source_of(argv: Sequence[str] | None = None, *, root: Path | None = None) -> str:
    """Where ``load(argv)`` takes the configuration from, for logs and tags."""
    root = Path(root) if root is not None else project_root()
    overrides = list(sys.argv[1:] if argv is None else argv)
    base = "params.yaml" if (root / "params.yaml").is_file() else "conf/"
    return f"{base} + overrides: " + " ".join(overrides) if overrides else base


def recomposed(argv: Sequence[str] | None = None, *, root: Path | None = None) -> str | None:
    """One line saying which sections a group switch recomposed from ``conf/`` instead of
    taking them from ``params.yaml``; None when nothing was (no switch, or no params.yaml)."""
    root = Path(root) if root is not None else project_root()
    overrides = list(sys.argv[1:] if argv is None else argv)
    if not overrides or not (root / "params.yaml").is_file():
        return None
    switches = group_switches(overrides, root=root)
    if not switches:
        return None
    files = ", ".join(f"{g} from conf/{g}/{o}.yaml" for g, o in switches.items())
    return (f"{' '.join(f'{g}={o}' for g, o in switches.items())}: a group switch recomposes its section ({files}); "
            "every other value is params.yaml's (as DVC runs it) plus the overrides")


def group_switches(overrides: Sequence[str], *, root: Path | None = None) -> dict[str, str]:
    """``group -> option`` for each override that selects a conf/ group's option."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    root = Path(root) if root is not None else project_root()
    groups = group_options(root)
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise messages.compose_error(exc, overrides, root / "conf", config_class()) from None
    return {o.key_or_group: str(o.value()) for o in parsed
            if o.type is OverrideType.CHANGE and o.package is None and o.key_or_group in groups
            and not o.is_sweep_override() and isinstance(o.value(), str)}


def compose(overrides: Sequence[str] = (), *, root: Path | None = None, base=None):
    """Compose ``conf/`` with Hydra overrides, as DVC does for ``params.yaml`` (resolved).
    With ``base`` (``params.yaml``'s content) the primary config is ``base`` instead of
    ``conf/config.yaml``; a group switch among the overrides recomposes that group's section
    from ``conf/`` (see the module docstring)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    root = Path(root) if root is not None else project_root()
    conf = root / "conf"
    if not (conf / f"{CONFIG_NAME}.yaml").is_file():
        raise ConfigError(f"{conf / (CONFIG_NAME + '.yaml')}: missing; run from the repository or set ODT_PROJECT_ROOT")
    name = CONFIG_NAME if base is None else register_params_primary(base, overrides, root)
    try:
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = hydra_compose(config_name=name, overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise messages.compose_error(exc, overrides, conf, config_class()) from None
    return cfg


def register_params_primary(base: DictConfig, overrides: Sequence[str], root: Path) -> str:
    """Register ``params.yaml``'s content as a primary config in Hydra's ConfigStore and
    return its name: the sections of the groups the overrides switch are left out and
    those groups put in its defaults list (their option comes from ``conf/``), with
    conf/config.yaml's ``hydra`` node and ``override hydra/...`` entries."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig, OmegaConf

    switches = group_switches(overrides, root=root)
    path = root / "conf" / f"{CONFIG_NAME}.yaml"
    primary = OmegaConf.load(path)
    if not isinstance(primary, DictConfig):
        raise ConfigError(f"{path}: not a mapping (a defaults list and sections); restore it from the repository")
    hydra_defaults = [d for d in primary.get("defaults", []) if isinstance(d, Mapping) and str(next(iter(d))).startswith("override hydra/")]
    body = {k: v for k, v in _plain_dict(base).items() if k not in switches and k != "defaults"}
    node = {"defaults": [*({g: o} for g, o in switches.items()), "_self_", *hydra_defaults], **body}
    if "hydra" in primary:
        node["hydra"] = OmegaConf.to_container(primary.hydra)
    ConfigStore.instance().store(name=PARAMS_PRIMARY, node=OmegaConf.create(node))
    return PARAMS_PRIMARY


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


# The block checks: validation, kept beside validate(), their one caller.
def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# What each constructor argument accepts, by name, for every block that takes it. The engine
# checks some of these itself (with ValueError, reported too); the pipeline needs the rest
# before any work, and a scalar loss to train on (reduction none is not for it).
ARGUMENT_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "betas": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
              "two numbers in [0, 1)"),
    "eps": (lambda v: _number(v) and v > 0, "a number > 0"),
    "weight_decay": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "momentum": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "nesterov": (lambda v: isinstance(v, bool), "true or false"),
    "max_norm": (lambda v: v is None or _number(v) and v > 0, "null or a number > 0"),
    "mode": (lambda v: v in ("ort", "torch"), "ort (onnxruntime's AdamW) or torch (torch.optim's)"),
    "reduction": (lambda v: v in ("mean", "sum"), "mean or sum (training needs a scalar loss)"),
    "label_smoothing": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "ignore_index": (lambda v: v is None or isinstance(v, int) and not isinstance(v, bool), "null or a class id"),
    "weight": (lambda v: v is None or isinstance(v, (list, tuple)) and all(_number(w) and w >= 0 for w in v),
               "null or a list of numbers >= 0"),
    "pos_weight": (lambda v: v is None or isinstance(v, (list, tuple)) and all(_number(w) and w >= 0 for w in v),
                   "null or a list of numbers >= 0"),
}


def check_block(key: str, node: Any, blocks: Blocks) -> None:
    """``node`` (at ``key``) names an allowed class and only its arguments, with allowed values,
    and the class accepts them; every failure is a ConfigError naming the key. Only then is
    the node built (Hydra's instantiate), and only to let the constructor check it too."""
    from hydra.utils import instantiate  # hydra's import is slow: only where a node is built

    allowed = blocks.classes()
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise ConfigError(f"{key}: needs _target_, the {blocks.kind} class (one of: {', '.join(allowed)}), "
                          "beside its constructor arguments")
    target = node["_target_"]
    if target not in allowed:
        raise ConfigError(f"{key}._target_={show(target)}: not an allowed {blocks.kind}; allowed targets: {', '.join(allowed)}"
                          + did_you_mean(str(target), list(allowed)))
    cls = allowed[target]
    for arg, value in node.items():
        if arg == "_target_":
            continue
        if arg not in arguments(cls):
            raise ConfigError(unknown_block_key(f"{key}.{arg}", blocks, target))
        ok, expected = ARGUMENT_CHECKS.get(arg, (lambda v: True, ""))
        if not ok(value):
            raise ConfigError(f"{key}.{arg}={show(value)}: expected {expected}")
    try:
        instantiate(dict(node), _convert_="all")
    except Exception as exc:  # the engine's constructors raise ValueError or TypeError on what they reject
        cause = exc.__cause__ or exc
        raise ConfigError(f"{key}: {target} rejects its arguments ({first_line(cause)})") from None


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

    return _plain_dict(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


def _plain_dict(node: DictConfig, **options: Any) -> dict:
    """A DictConfig as a plain dict (OmegaConf.to_container's own type is any container)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, **options)
    if not isinstance(plain, dict):  # a DictConfig gives a dict; a broken one names itself here, not in a caller
        raise ConfigError(f"expected a mapping of sections, got {type(plain).__name__}")
    return plain


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
