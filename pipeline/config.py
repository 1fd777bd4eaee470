"""The configuration schema, and how a stage gets its configuration.

Where a stage's configuration comes from (``load``):

1. Overrides on the command line (``python -m pipeline.train optimizer.lr=3e-3``):
   Hydra composes ``conf/`` plus the overrides (Hydra's override grammar). A hand run.
2. No overrides and ``params.yaml`` exists: ``params.yaml`` as it is. This is how DVC
   runs every stage (``dvc exp run`` recomposes ``params.yaml`` from ``conf/`` and its
   ``-S`` overrides first; ``dvc repro`` uses the committed file), and a hand run with no
   overrides reproduces exactly what DVC would run.
3. Neither: Hydra composes ``conf/``.

Whatever the source, the result is merged into the dataclass schema below, which
rejects unknown keys and wrong types, then checked for values out of range, all before
any work starts. Every error is a ``ConfigError`` naming the key and what is allowed.
"""
from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from pipeline.errors import ConfigError
from pipeline.paths import project_root

CONFIG_NAME = "config"


# --------------------------------------------------------------------------- schema


class DataName(Enum):
    digits = "digits"


class UserFormat(Enum):
    auto = "auto"
    npz = "npz"
    csv = "csv"
    images = "images"


class Ink(Enum):
    auto = "auto"
    light_on_dark = "light_on_dark"
    dark_on_light = "dark_on_light"


class ModelSource(Enum):
    builtin = "builtin"
    onnx = "onnx"
    torch = "torch"


class Arch(Enum):
    mlp = "mlp"
    cnn = "cnn"


class Select(Enum):
    last_n = "last_n"
    all = "all"
    globs = "globs"


class LossName(Enum):
    cross_entropy = "cross_entropy"
    mse = "mse"
    bce_with_logits = "bce_with_logits"
    l1 = "l1"


class Reduction(Enum):
    mean = "mean"
    sum = "sum"


class OptimizerName(Enum):
    adamw = "adamw"
    sgd = "sgd"


class ScheduleName(Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class PretrainMode(Enum):
    auto = "auto"
    train = "train"
    skip = "skip"


@dataclass
class StyleConfig:
    """The simulated user's handwriting, applied to 32x32 bitmaps (see pipeline/prepare.py)."""

    slant_deg: float = 22.0
    stroke: int = 1
    jitter_deg: float = 3.0
    shift: list[float] = field(default_factory=lambda: [0.0, 0.0])


@dataclass
class DataConfig:
    name: DataName = DataName.digits
    input_shape: list[int] = field(default_factory=lambda: [1, 8, 8])
    num_classes: int = 10
    test_fraction: float = 0.2
    user_samples: int = 450
    user_train_per_class: int = 15
    style: StyleConfig = field(default_factory=StyleConfig)
    user_data: Optional[str] = None
    user_format: UserFormat = UserFormat.auto
    user_holdout_fraction: float = 0.5
    label_column: str = "label"
    pixel_max: Optional[float] = None
    ink: Ink = Ink.auto


@dataclass
class ModelConfig:
    source: ModelSource = ModelSource.builtin
    arch: Optional[Arch] = None
    hidden: list[int] = field(default_factory=list)
    channels: list[int] = field(default_factory=list)
    kernel_size: int = 3
    path: Optional[str] = None
    torch_class: Optional[str] = None
    torch_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainableConfig:
    select: Select = Select.last_n
    last_n: int = 1
    params: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)


@dataclass
class LossConfig:
    name: LossName = LossName.cross_entropy
    reduction: Reduction = Reduction.mean


@dataclass
class ScheduleConfig:
    name: ScheduleName = ScheduleName.constant
    warmup_steps: int = 0


@dataclass
class AdamWHparams:
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: Optional[float] = None


@dataclass
class SGDHparams:
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None


HPARAMS = {OptimizerName.adamw: AdamWHparams, OptimizerName.sgd: SGDHparams}


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 3e-3
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # baked into optimizer_model.onnx; validated against HPARAMS[name] in validate()
    hparams: Any = field(default_factory=dict)


@dataclass
class TrainConfig:
    epochs: int = 20
    shuffle: bool = True
    checkpoint_every: int = 50
    log_every: int = 1
    # continue from this checkpoint (e.g. data/promoted/checkpoint) instead of the base
    init_checkpoint: Optional[str] = None
    # its SHA-256: the checkpoint is not a DVC dependency, so this param is its cache key
    init_sha256: Optional[str] = None


@dataclass
class DeviceConfig:
    name: str = "phone"
    threads: int = 2
    batch_size: int = 16
    max_steps: Optional[int] = None
    max_seconds: Optional[float] = None


@dataclass
class PretrainConfig:
    mode: PretrainMode = PretrainMode.auto
    epochs: int = 15
    batch_size: int = 64
    optimizer: OptimizerName = OptimizerName.adamw
    lr: float = 3e-3
    weight_decay: float = 1e-4


@dataclass
class EvaluateConfig:
    batch_size: int = 256


@dataclass
class ExportConfig:
    ir_version: int = 10
    check_onnxruntime: bool = True
    check_atol: float = 1e-4


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "odt"
    log_artifacts: bool = True
    registered_model: str = "odt-personalized"  # the model registry's name for what the retraining job promotes


@dataclass
class RetrainConfig:
    inbox: str = "data/user"
    promoted_dir: str = "data/promoted"
    state_dir: str = "data/retrain"
    continue_from_promoted: bool = True
    min_delta: float = 0.0
    max_forgetting: Optional[float] = None
    wait_seconds: float = 0.0


class StrategyName(Enum):  # Flower's strategies (odt_ops.federated.flower.STRATEGIES; a test keeps the two equal)
    fedavg = "fedavg"
    fedprox = "fedprox"
    fedadam = "fedadam"
    fedyogi = "fedyogi"
    fedadagrad = "fedadagrad"
    fedavgm = "fedavgm"
    fedmedian = "fedmedian"
    fedtrimmedavg = "fedtrimmedavg"
    krum = "krum"
    multikrum = "multikrum"
    bulyan = "bulyan"


class DiffEncoding(Enum):
    float32 = "float32"
    float16 = "float16"
    int8 = "int8"


class DPMode(Enum):
    server_fixed = "server_fixed"
    server_adaptive = "server_adaptive"
    client_fixed = "client_fixed"


@dataclass
class DPConfig:
    enabled: bool = False
    mode: DPMode = DPMode.server_fixed
    noise_multiplier: float = 0.1
    clipping_norm: float = 1.0


@dataclass
class PopulationConfig:
    """The simulated users of the federate stage (see pipeline/federate.py)."""

    train_per_client: int = 30
    holdout_per_client: int = 30
    label_alpha: float = 1.0
    slant_deg: list[float] = field(default_factory=lambda: [5.0, 35.0])
    strokes: list[int] = field(default_factory=lambda: [0, 1, 2])
    jitter_deg: float = 3.0


@dataclass
class FederatedConfig:
    strategy: StrategyName = StrategyName.fedavg
    strategy_options: dict[str, Any] = field(default_factory=dict)
    rounds: int = 8
    clients: int = 10
    fraction_train: float = 0.5
    fraction_evaluate: float = 1.0
    min_successful_clients: int = 2
    local_epochs: int = 3
    batch_size: int = 16
    lr: float = 0.005
    mu: float = 0.0
    encoding: DiffEncoding = DiffEncoding.float32
    dp: DPConfig = field(default_factory=DPConfig)
    finetune_epochs: int = 10
    population: PopulationConfig = field(default_factory=PopulationConfig)
    num_cpus: int = 2


@dataclass
class Config:
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainable: TrainableConfig = field(default_factory=TrainableConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)


# --------------------------------------------------------------------------- loading


def load(argv: Sequence[str] | None = None, *, root: Path | None = None):
    """The validated configuration (a DictConfig) for a stage; see the module docstring."""
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
            raise ConfigError(f"{params}: not readable YAML ({_first_line(exc)}); regenerate it with `dvc exp run`") from None
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
        raise _compose_error(exc, overrides, conf) from None
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


def _compose_error(exc: BaseException, overrides: Sequence[str], conf: Path) -> ConfigError:
    msg = str(exc)
    # model=cnnn: "In 'config': Could not find 'model/cnnn'" (+ options list)
    m = re.search(r"Could not find '([^']+)/([^'/]+)'", msg)
    if m:
        group, option = m.group(1), m.group(2)
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        return ConfigError(
            f"{group}={option}: no such option in config group '{group}'; allowed: {', '.join(options)}"
            + _did_you_mean(option, options)
        )
    # optimizer.lrr=1: "Could not override 'optimizer.lrr'" with a ConfigKeyError cause
    m = re.search(r"Could not (?:override|append to) '([^']+)'", msg)
    if m:
        key = m.group(1)
        override = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), key)
        cause = exc.__cause__ or exc.__context__
        if cause is not None and "not in struct" not in str(cause) and "not found" not in str(cause).lower():
            return ConfigError(f"override '{override}': {_first_line(cause)}")
        return ConfigError(f"override '{override}': {_unknown_key_message(key)}")
    if "ParseException" in type(exc).__name__ or "Error parsing override" in msg:
        return ConfigError(f"cannot parse the overrides {list(overrides)}: {_first_line(exc)} (Hydra grammar: key=value, group=option, +key=value)")
    return ConfigError(f"cannot compose conf/ with overrides {list(overrides)}: {_first_line(exc)}")


# --------------------------------------------------------------------------- validation


def validate(raw) -> Any:
    """Merge ``raw`` into the schema and check value ranges; returns the typed DictConfig."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(raw, DictConfig):
        raise ConfigError(f"the configuration must be a mapping of sections, got {type(raw).__name__}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except OmegaConfBaseException as exc:
        raise _schema_error(exc, Config) from None
    name = cfg.optimizer.name
    hp_schema = HPARAMS[name]
    hparams = cfg.optimizer.hparams
    if hparams is None:
        hparams = {}
    if not isinstance(hparams, (dict, DictConfig)):
        raise ConfigError(f"optimizer.hparams={_show(hparams)}: expected {_describe(hp_schema)} (optimizer {name.value})")
    try:
        cfg.optimizer.hparams = OmegaConf.merge(OmegaConf.structured(hp_schema), hparams)
    except OmegaConfBaseException as exc:
        raise _schema_error(exc, hp_schema, prefix="optimizer.hparams", owner=f"optimizer {name.value}") from None
    _check_values(cfg)
    return cfg


def _check_values(cfg) -> None:
    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            raise ConfigError(f"{key}={_show(value)}: expected {allowed}")

    d = cfg.data
    need(len(d.input_shape) >= 1 and all(n >= 1 for n in d.input_shape), "data.input_shape", list(d.input_shape), "a list of positive integers")
    need(d.num_classes >= 2, "data.num_classes", d.num_classes, "an integer >= 2")
    need(0 < d.test_fraction < 1, "data.test_fraction", d.test_fraction, "a fraction strictly between 0 and 1")
    need(0 < d.user_holdout_fraction < 1, "data.user_holdout_fraction", d.user_holdout_fraction, "a fraction strictly between 0 and 1")
    need(d.user_samples >= 2 * d.num_classes, "data.user_samples", d.user_samples, f"an integer >= 2 * data.num_classes ({2 * d.num_classes})")
    need(d.user_train_per_class >= 1, "data.user_train_per_class", d.user_train_per_class, "an integer >= 1")
    need(d.user_train_per_class * d.num_classes < d.user_samples, "data.user_train_per_class", d.user_train_per_class,
         f"fewer than data.user_samples / data.num_classes ({d.user_samples / d.num_classes:g}) so a holdout remains")
    need(d.style.stroke >= 0, "data.style.stroke", d.style.stroke, "an integer >= 0 (pixels at 32x32)")
    need(-60 <= d.style.slant_deg <= 60, "data.style.slant_deg", d.style.slant_deg, "degrees in [-60, 60]")
    need(d.style.jitter_deg >= 0, "data.style.jitter_deg", d.style.jitter_deg, "degrees >= 0")
    need(len(d.style.shift) == 2, "data.style.shift", list(d.style.shift), "two numbers [down, right] in 8x8 pixels")
    need(d.pixel_max is None or d.pixel_max > 0, "data.pixel_max", d.pixel_max, "null or a number > 0")
    need(bool(d.label_column), "data.label_column", d.label_column, "a non-empty column name")

    m = cfg.model
    if m.source is ModelSource.builtin:
        need(m.arch is not None, "model.arch", m.arch, f"one of {_enum_values(Arch)} when model.source=builtin")
        need(all(h >= 1 for h in m.hidden), "model.hidden", list(m.hidden), "a list of positive layer widths")
        need(all(c >= 1 for c in m.channels), "model.channels", list(m.channels), "a list of positive channel counts")
        need(m.arch is not Arch.cnn or len(m.channels) >= 1, "model.channels", list(m.channels), "at least one channel count for arch=cnn")
        need(m.kernel_size >= 1 and m.kernel_size % 2 == 1, "model.kernel_size", m.kernel_size, "an odd integer >= 1")
    elif m.source is ModelSource.onnx:
        need(bool(m.path), "model.path", m.path, "a path to an .onnx file (relative to the repository) or zoo:<name> when model.source=onnx")
    elif m.source is ModelSource.torch:
        need(bool(m.torch_class) and ":" in m.torch_class, "model.torch_class", m.torch_class,
             "'package.module:Class' when model.source=torch")

    t = cfg.trainable
    need(t.last_n >= 1, "trainable.last_n", t.last_n, "an integer >= 1")
    need(t.select is not Select.globs or len(t.params) > 0, "trainable.params", list(t.params), "at least one glob when trainable.select=globs")

    o = cfg.optimizer
    need(o.lr > 0, "optimizer.lr", o.lr, "a number > 0")
    need(o.schedule.warmup_steps >= 0, "optimizer.schedule.warmup_steps", o.schedule.warmup_steps, "an integer >= 0")
    hp = o.hparams
    need(hp.weight_decay >= 0, "optimizer.hparams.weight_decay", hp.weight_decay, "a number >= 0")
    need(hp.max_grad_norm is None or hp.max_grad_norm > 0, "optimizer.hparams.max_grad_norm", hp.max_grad_norm, "null or a number > 0")
    if o.name is OptimizerName.adamw:
        need(len(hp.betas) == 2 and all(0 <= b < 1 for b in hp.betas), "optimizer.hparams.betas", list(hp.betas), "two numbers in [0, 1)")
        need(hp.eps > 0, "optimizer.hparams.eps", hp.eps, "a number > 0")
    else:
        need(0 <= hp.momentum < 1, "optimizer.hparams.momentum", hp.momentum, "a number in [0, 1)")

    need(cfg.train.epochs >= 1, "train.epochs", cfg.train.epochs, "an integer >= 1")
    need(cfg.train.checkpoint_every >= 0, "train.checkpoint_every", cfg.train.checkpoint_every, "an integer >= 0 (0: final checkpoint only)")
    need(cfg.train.log_every >= 1, "train.log_every", cfg.train.log_every, "an integer >= 1")
    sha = cfg.train.init_sha256
    need(sha is None or bool(re.fullmatch(r"[0-9a-f]{64}", sha)), "train.init_sha256", sha, "null or 64 lowercase hex digits (sha256sum of train.init_checkpoint)")
    need(sha is None or bool(cfg.train.init_checkpoint), "train.init_sha256", sha, "null when train.init_checkpoint is null")
    dv = cfg.device
    need(dv.threads >= 1, "device.threads", dv.threads, "an integer >= 1")
    need(dv.batch_size >= 1, "device.batch_size", dv.batch_size, "an integer >= 1")
    need(dv.max_steps is None or dv.max_steps >= 1, "device.max_steps", dv.max_steps, "null or an integer >= 1")
    need(dv.max_seconds is None or dv.max_seconds > 0, "device.max_seconds", dv.max_seconds, "null or a number > 0")
    p = cfg.pretrain
    need(p.epochs >= 0, "pretrain.epochs", p.epochs, "an integer >= 0 (0: keep the initial weights)")
    need(p.batch_size >= 1, "pretrain.batch_size", p.batch_size, "an integer >= 1")
    need(p.lr > 0, "pretrain.lr", p.lr, "a number > 0")
    need(p.weight_decay >= 0, "pretrain.weight_decay", p.weight_decay, "a number >= 0")
    need(cfg.evaluate.batch_size >= 1, "evaluate.batch_size", cfg.evaluate.batch_size, "an integer >= 1")
    need(10 <= cfg.export.ir_version <= 13, "export.ir_version", cfg.export.ir_version,
         "an integer in [10, 13] (opset 21 models need IR >= 10; onnxruntime loads <= 13)")
    need(cfg.export.check_atol > 0, "export.check_atol", cfg.export.check_atol, "a number > 0")
    r = cfg.retrain
    for key in ("inbox", "promoted_dir", "state_dir"):
        need(bool(r[key]), f"retrain.{key}", r[key], "a path relative to the repository")
    need(r.max_forgetting is None or r.max_forgetting >= 0, "retrain.max_forgetting", r.max_forgetting, "null or a number >= 0 (accuracy points as a fraction)")
    need(r.wait_seconds >= 0, "retrain.wait_seconds", r.wait_seconds, "a number >= 0 (0: exit at once when a job is running)")
    need(bool(cfg.tracking.experiment), "tracking.experiment", cfg.tracking.experiment, "a non-empty experiment name")
    f = cfg.federated
    for key in ("rounds", "clients", "local_epochs", "batch_size", "min_successful_clients", "num_cpus"):
        need(f[key] >= 1, f"federated.{key}", f[key], "an integer >= 1")
    need(f.finetune_epochs >= 0, "federated.finetune_epochs", f.finetune_epochs, "an integer >= 0")
    need(f.min_successful_clients <= f.clients, "federated.min_successful_clients", f.min_successful_clients,
         f"at most federated.clients ({f.clients})")
    for key in ("fraction_train", "fraction_evaluate"):
        need(0 < f[key] <= 1, f"federated.{key}", f[key], "a number in (0, 1]")
    need(f.lr > 0, "federated.lr", f.lr, "a number > 0")
    need(f.mu >= 0, "federated.mu", f.mu, "a number >= 0 (0: no proximal term)")
    need(f.dp.noise_multiplier >= 0, "federated.dp.noise_multiplier", f.dp.noise_multiplier, "a number >= 0")
    need(f.dp.clipping_norm > 0, "federated.dp.clipping_norm", f.dp.clipping_norm, "a number > 0")
    pop = f.population
    need(pop.train_per_client >= 1, "federated.population.train_per_client", pop.train_per_client, "an integer >= 1")
    need(pop.holdout_per_client >= 1, "federated.population.holdout_per_client", pop.holdout_per_client, "an integer >= 1")
    need(pop.label_alpha > 0, "federated.population.label_alpha", pop.label_alpha, "a number > 0 (smaller: more skewed labels)")
    need(len(pop.slant_deg) == 2 and pop.slant_deg[0] <= pop.slant_deg[1], "federated.population.slant_deg", list(pop.slant_deg),
         "[low, high] degrees")
    need(len(pop.strokes) >= 1 and all(s >= 0 for s in pop.strokes), "federated.population.strokes", list(pop.strokes),
         "a non-empty list of integers >= 0")


def _schema_error(exc, schema: type, *, prefix: str = "", owner: str | None = None) -> ConfigError:
    """Turn an OmegaConf merge error into one line naming the key and what it allows."""
    from omegaconf.errors import ConfigKeyError

    full_key = str(getattr(exc, "full_key", "") or "")
    key = f"{prefix}.{full_key}" if prefix and full_key else (prefix or full_key)
    value = _offending_value(exc)
    if isinstance(exc, ConfigKeyError):
        return ConfigError(_unknown_key_message(key, schema=schema, prefix=prefix, owner=owner))
    tp = _field_type(schema, full_key)
    if tp is None:
        return ConfigError(f"{key or 'configuration'}: {_first_line(exc)}")
    shown = f"={value!r}" if value is not None else ""
    return ConfigError(f"{key}{shown}: expected {_describe(tp)}")


def _unknown_key_message(key: str, *, schema: type = Config, prefix: str = "", owner: str | None = None) -> str:
    parts = key.split(".")
    parent_key = ".".join(parts[:-1])
    local_parent = parent_key[len(prefix) + 1:] if prefix and parent_key.startswith(prefix + ".") else ("" if parent_key == prefix else parent_key)
    parent = _field_type(schema, local_parent) if local_parent else schema
    if parent_key == "optimizer.hparams" and not prefix:
        per_name = {n.value: sorted(f.name for f in fields(h)) for n, h in HPARAMS.items()}
        union = sorted({k for ks in per_name.values() for k in ks})
        takes = "; ".join(f"{n}: {', '.join(ks)}" for n, ks in per_name.items())
        owners = [n for n, ks in per_name.items() if parts[-1] in ks]
        hint = f" ('{parts[-1]}' is a hyperparameter of {' and '.join(owners)} only)" if owners else _did_you_mean(parts[-1], union, prefix=parent_key)
        return f"unknown key '{key}'; optimizer.hparams takes ({takes})" + hint
    if parent is not None and is_dataclass(parent):
        allowed = sorted(f.name for f in fields(parent))
        where = owner or (f"'{parent_key}'" if parent_key else "the top level")
        return (
            f"unknown key '{key}'; {where} takes: {', '.join(allowed)}"
            + _did_you_mean(parts[-1], allowed, prefix=parent_key)
        )
    return f"unknown key '{key}'"


def _show(value: Any) -> str:
    """A config value as YAML would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _offending_value(exc) -> Any:
    m = re.search(r"Value '([^']*)'|Invalid value '([^']*)'", str(exc))
    if m:
        return m.group(1) if m.group(1) is not None else m.group(2)
    return None


def _field_type(schema: type, dotted: str) -> Any:
    """The annotated type at ``dotted`` (``a.b[1]``) inside ``schema``, or None."""
    tp: Any = schema
    for token in re.findall(r"[^.\[\]]+", dotted):
        tp = _strip_optional(tp)
        if is_dataclass(tp):
            hints = get_type_hints(tp)
            if token not in hints:
                return None
            tp = hints[token]
        elif get_origin(tp) in (list, Sequence) and token.isdigit():
            tp = get_args(tp)[0] if get_args(tp) else Any
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1] if get_args(tp) else Any
        else:
            return None
    return tp


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _describe(tp: Any) -> str:
    optional = get_origin(tp) is Union and type(None) in get_args(tp)
    base = _strip_optional(tp)
    if isinstance(base, type) and issubclass(base, Enum):
        text = f"one of: {_enum_values(base)}"
    elif base is bool:
        text = "true or false"
    elif base is int:
        text = "an integer"
    elif base is float:
        text = "a number"
    elif base is str:
        text = "a string"
    elif get_origin(base) is list:
        (item,) = get_args(base) or (Any,)
        text = f"a list of {_describe(item).removeprefix('an ').removeprefix('a ')}s"
    elif is_dataclass(base):
        text = f"a section with keys {', '.join(f.name for f in fields(base))}"
    elif get_origin(base) is dict:
        text = "a mapping"
    else:
        text = "a value"
    return f"{text} or null" if optional else text


def _enum_values(enum: type[Enum]) -> str:
    return ", ".join(e.value for e in enum)


def _did_you_mean(word: str, options: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def to_container(cfg) -> dict:
    """Plain dict (enums as strings) for JSON files and MLflow params."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def nest(flat: dict[str, Any]) -> dict:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``, the inverse of ``flatten``."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.config [--check] [overrides...]``: print or check params.yaml."""
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


if __name__ == "__main__":
    sys.exit(main())
