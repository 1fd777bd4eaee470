"""The framework-neutral local round: closed forms for SGD and FedProx, updates, evaluation, determinism."""
import subprocess
import sys

import numpy as np
import pytest

from odt_ops.errors import ArgumentError, ArgumentTypeError, InputError, ModelDiffError, TrainingDivergedError
from odt_ops.export import apply_diff, model_diff
from odt_ops.federated import LocalTrainer, RoundConfig, fingerprint
from tests.federated.helpers import linear_artifacts, mlp_artifacts


@pytest.fixture(scope="module")
def linear_dir(tmp_path_factory):
    return linear_artifacts(tmp_path_factory.mktemp("linear"))


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    return mlp_artifacts(tmp_path_factory.mktemp("mlp"))


def _data(n=24, n_in=5, n_out=3, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n_in)).astype(np.float32), rng.standard_normal((n, n_out)).astype(np.float32)


def _closed_form(w, b, x, t, *, w_glob, b_glob, lr, mu, steps):
    """Full-batch SGD on mean((x W^T + b - t)^2) + mu/2 ||(W, b) - (W_g, b_g)||^2, in float64."""
    w, b = w.astype(np.float64), b.astype(np.float64)
    x, t = x.astype(np.float64), t.astype(np.float64)
    for _ in range(steps):
        r = x @ w.T + b - t
        gw = 2.0 / r.size * r.T @ x + mu * (w - w_glob)
        gb = 2.0 / r.size * r.sum(0) + mu * (b - b_glob)
        w, b = w - lr * gw, b - lr * gb
    return w, b


@pytest.mark.parametrize("mu", [0.0, 0.5, 3.0])
def test_fedprox_equals_the_closed_form(linear_dir, mu):
    """Starting away from the global model, every step's gradient carries mu * (w - w_global)."""
    trainer = LocalTrainer(linear_dir)
    x, t = _data()
    base = trainer.parameters()
    rng = np.random.default_rng(7)
    start = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.5) for k, v in base.items()}
    # the round starts from `start`; the proximal anchor is the global model `base`
    from odt_ops.federated import ProximalTerm

    trainer.set_parameters(start)
    prox = ProximalTerm(trainer.state, base, mu)
    opt = trainer._fresh_optimizer()
    opt.set_learning_rate(0.05)
    for _ in range(6):
        trainer.module.train()
        trainer.module(x, t)
        prox.add_gradient()
        opt.step()
        trainer.module.lazy_reset_grad()
    got = trainer.parameters()
    w, b = _closed_form(start["fc.weight"], start["fc.bias"], x, t, w_glob=base["fc.weight"].astype(np.float64),
                        b_glob=base["fc.bias"].astype(np.float64), lr=0.05, mu=mu, steps=6)
    np.testing.assert_allclose(got["fc.weight"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["fc.bias"], b, rtol=1e-5, atol=1e-6)
    # and the term's value is the closed form's
    expected = 0.5 * mu * sum(float(np.sum((got[k].astype(np.float64) - base[k]) ** 2)) for k in base)
    assert prox.value() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("mu", [0.0, 2.0])
def test_local_round_equals_the_closed_form(linear_dir, mu):
    """train_round: full-batch SGD epochs from the global parameters; the diff is trained - global."""
    trainer = LocalTrainer(linear_dir)
    x, t = _data()
    rng = np.random.default_rng(3)
    glob = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.2) for k, v in trainer.base.items()}
    res = trainer.train_round(glob, x, t, RoundConfig(epochs=5, batch_size=len(x), learning_rate=0.1, proximal_mu=mu, shuffle=False))
    # the first step's proximal gradient is zero (w == w_global); later ones pull back
    w, b = _closed_form(glob["fc.weight"], glob["fc.bias"], x, t, w_glob=glob["fc.weight"].astype(np.float64),
                        b_glob=glob["fc.bias"].astype(np.float64), lr=0.1, mu=mu, steps=5)
    np.testing.assert_allclose(res.parameters["fc.weight"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.parameters["fc.bias"], b, rtol=1e-5, atol=1e-6)
    assert res.num_examples == len(x)
    assert res.num_steps == 5
    np.testing.assert_array_equal(res.diff.deltas["fc.weight"], res.parameters["fc.weight"] - glob["fc.weight"])
    assert res.diff.base_hash == fingerprint(glob)
    assert res.update.encoding == "float32"
    assert res.metrics["update_bytes"] == (15 + 3) * 4


def test_fedprox_pulls_towards_the_global_model(linear_dir):
    trainer = LocalTrainer(linear_dir)
    x, t = _data()
    norms = [trainer.train_round(None, x, t, RoundConfig(epochs=20, batch_size=8, learning_rate=0.1, proximal_mu=mu)).metrics["update_norm"]
             for mu in (0.0, 1.0, 10.0)]
    assert norms[0] > norms[1] > norms[2] > 0


def test_the_update_as_a_diff_is_what_export_makes(linear_dir, tmp_path):
    """A local round's difference is odt_ops.export's model_diff, and applies back to the trained weights."""
    trainer = LocalTrainer(linear_dir)
    x, t = _data()
    res = trainer.train_round(None, x, t, RoundConfig(epochs=2, batch_size=6, learning_rate=0.05))
    from odt_ops.api import CheckpointState

    trained = CheckpointState.load_checkpoint(linear_dir / "checkpoint")
    for k, v in res.parameters.items():
        trained.parameters[k].data = v
    ref = model_diff(linear_dir / "checkpoint", trained, num_examples=len(x))
    assert ref.base_hash == res.diff.base_hash
    for k in ref.deltas:
        np.testing.assert_array_equal(ref.deltas[k], res.diff.deltas[k])
    applied = apply_diff(linear_dir / "checkpoint", res.diff)
    for k, v in res.parameters.items():  # base + (trained - base) is trained up to one float32 rounding
        np.testing.assert_allclose(applied.parameters[k], v, rtol=1e-6, atol=1e-8)


def test_global_model_as_a_diff_against_the_known_base(linear_dir):
    trainer = LocalTrainer(linear_dir)
    x, t = _data()
    first = trainer.train_round(None, x, t, RoundConfig(epochs=1, batch_size=6, learning_rate=0.05))
    # the server sends round 2's global model as a difference against the artifacts' weights
    by_arrays = trainer.train_round(first.parameters, x, t, RoundConfig(epochs=1, batch_size=6, learning_rate=0.05, server_round=2))
    by_diff = trainer.train_round(first.diff, x, t, RoundConfig(epochs=1, batch_size=6, learning_rate=0.05, server_round=2))
    for k in by_arrays.parameters:
        np.testing.assert_array_equal(by_arrays.parameters[k], by_diff.parameters[k])
    # a difference made from another base is refused, naming why
    other = dict(first.diff.deltas)
    from odt_ops.export import ModelDiff

    with pytest.raises(ModelDiffError, match="another base"):
        trainer.train_round(ModelDiff(other, "0" * 64), x, t, RoundConfig())


def test_rounds_are_deterministic_and_independent_of_history(mlp_dir):
    """Same inputs, same bits, whatever the trainer ran before (fresh optimizer, seeded shuffling)."""
    rng = np.random.default_rng(0)
    x = rng.random((40, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 40)
    cfg = RoundConfig(epochs=2, batch_size=8, learning_rate=0.1, seed=5, client_id=3, server_round=2)
    a = LocalTrainer(mlp_dir)
    first = a.train_round(None, x, y, cfg)
    a.train_round(None, x[:10], y[:10], RoundConfig(epochs=3, learning_rate=0.3, client_id=9))  # another client in between
    again = a.train_round(None, x, y, cfg)
    fresh = LocalTrainer(mlp_dir).train_round(None, x, y, cfg)
    for k in first.parameters:
        np.testing.assert_array_equal(first.parameters[k], again.parameters[k])
        np.testing.assert_array_equal(first.parameters[k], fresh.parameters[k])
    other_client = a.train_round(None, x, y, RoundConfig(epochs=2, batch_size=8, learning_rate=0.1, seed=5, client_id=4, server_round=2))
    assert any(not np.array_equal(first.parameters[k], other_client.parameters[k]) for k in first.parameters)


def test_evaluate_and_learning(mlp_dir):
    rng = np.random.default_rng(1)
    centers = rng.random((10, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 200)
    x = (centers[y] + 0.1 * rng.standard_normal((200, 1, 8, 8))).astype(np.float32)
    trainer = LocalTrainer(mlp_dir)
    before = trainer.evaluate(None, x, y)
    res = trainer.train_round(None, x, y, RoundConfig(epochs=5, batch_size=16, learning_rate=0.1))
    after = trainer.evaluate(res.parameters, x, y)
    assert after.num_examples == 200
    assert after.accuracy > before.accuracy + 0.3
    assert after.loss < before.loss
    # loss is the per-sample mean whatever the batch size
    assert trainer.evaluate(res.parameters, x, y, batch_size=7).loss == pytest.approx(after.loss, rel=1e-5)


def test_arrays_update_and_bad_inputs(mlp_dir):
    trainer = LocalTrainer(mlp_dir)
    x = np.zeros((4, 1, 8, 8), np.float32)
    y = np.zeros(4, np.int64)
    res = trainer.train_round(None, x, y, RoundConfig(update="arrays"))
    assert set(res.update) == set(trainer.trainable)
    with pytest.raises(InputError, match="not trainable here"):
        trainer.train_round({**trainer.base, "bogus": np.zeros(1, np.float32)}, x, y)
    with pytest.raises(InputError, match="NaN"):
        trainer.train_round({**trainer.base, "fc0.bias": np.full(32, np.nan, np.float32)}, x, y)
    with pytest.raises(ArgumentError, match="learning_rate=-1.0"):
        RoundConfig(learning_rate=-1.0)
    with pytest.raises(ModelDiffError, match="encoding"):
        RoundConfig(encoding="int4")
    with pytest.raises(TrainingDivergedError), np.errstate(all="ignore"):
        huge = {k: v * 1e30 for k, v in trainer.base.items()}
        trainer.train_round(huge, np.ones((4, 1, 8, 8), np.float32) * 1e30, y, RoundConfig(learning_rate=1e30))


def test_the_engine_imports_without_flower():
    code = ("import sys; sys.modules['flwr'] = None; import odt_ops.federated, odt_ops.federated.local, odt_ops.federated.settings; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok", out.stderr
    grep = subprocess.run([sys.executable, "-c", "import pathlib, odt_ops.federated as f; d = pathlib.Path(f.__file__).parent; "
                           "print(sorted(p.name for p in d.glob('*.py') if 'import flwr' in p.read_text() or 'from flwr' in p.read_text()))"],
                          capture_output=True, text=True, timeout=120)
    # Flower's layout (client app, server app, task, simulation, SecAgg+); the settings stay free of it
    assert grep.stdout.strip() == "['client_app.py', 'secagg.py', 'server_app.py', 'simulation.py', 'task.py']"


def test_round_config_as_the_readme_wrote_it_is_refused_naming_seed(mlp_dir):
    """The README's RoundConfig(epochs, batch_size, learning_rate, proximal_mu, encoding): the fifth field is seed."""
    with pytest.raises(ValueError, match="unrecognized seed string"):  # where it failed before: numpy, mid-round
        np.random.default_rng(["int8", 0, 0])
    with pytest.raises(ArgumentTypeError, match=r"seed='int8' is str.*positional fields are epochs, batch_size, learning_rate, "
                                                r"proximal_mu, seed; pass the others, encoding among them, by keyword") as info:
        RoundConfig(3, 16, 5e-3, 0.1, "int8")
    assert isinstance(info.value, TypeError)
    cfg = RoundConfig(3, 16, 5e-3, 0.1, encoding="int8")  # what the README meant
    res = LocalTrainer(mlp_dir).train_round(None, np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64), cfg)
    assert res.update.encoding == "int8" and res.num_steps == 3


@pytest.mark.parametrize("field, value, error", [
    ("epochs", 0, ArgumentError), ("epochs", 1.5, ArgumentTypeError), ("epochs", True, ArgumentTypeError), ("epochs", "2", ArgumentTypeError),
    ("batch_size", 0, ArgumentError), ("batch_size", 8.0, ArgumentTypeError), ("batch_size", None, ArgumentTypeError),
    ("learning_rate", float("nan"), ArgumentError), ("learning_rate", float("inf"), ArgumentError), ("learning_rate", -1e-3, ArgumentError),
    ("learning_rate", "1e-3", ArgumentTypeError), ("learning_rate", None, ArgumentTypeError), ("learning_rate", 10**400, ArgumentError),
    ("proximal_mu", -0.1, ArgumentError), ("proximal_mu", float("nan"), ArgumentError), ("proximal_mu", "0.1", ArgumentTypeError),
    ("seed", -1, ArgumentError), ("seed", None, ArgumentTypeError), ("seed", 1.0, ArgumentTypeError), ("seed", "int8", ArgumentTypeError),
    ("client_id", -3, ArgumentError), ("client_id", "3", ArgumentTypeError), ("server_round", -1, ArgumentError),
    ("shuffle", 1, ArgumentTypeError), ("max_steps", -1, ArgumentError), ("max_steps", 2.5, ArgumentTypeError),
    ("update", "weights", ArgumentError), ("update", None, ArgumentTypeError), ("encoding", 8, ArgumentTypeError),
    ("clip_norm", 0.0, ArgumentError), ("clip_norm", float("nan"), ArgumentError), ("clip_norm", float("inf"), ArgumentError),
    ("clip_norm", "1", ArgumentTypeError),
])
def test_round_config_refuses_each_bad_field_naming_it(field, value, error):
    with pytest.raises(error, match=f"RoundConfig: {field}=") as info:
        RoundConfig(**{field: value})
    assert type(info.value) is error


def test_round_config_takes_numpy_numbers_as_python_ones():
    cfg = RoundConfig(epochs=np.int64(2), batch_size=np.int32(8), learning_rate=np.float32(0.5), proximal_mu=np.int64(0),
                      seed=np.uint64(7), max_steps=np.int16(3), clip_norm=np.float64(1.0))
    assert (cfg.epochs, cfg.batch_size, cfg.learning_rate, cfg.proximal_mu, cfg.seed, cfg.max_steps, cfg.clip_norm) == (2, 8, 0.5, 0.0, 7, 3, 1.0)
    assert all(type(v) in (int, float) for v in (cfg.epochs, cfg.batch_size, cfg.learning_rate, cfg.proximal_mu, cfg.seed))
    assert RoundConfig(max_steps=0, clip_norm=None).max_steps == 0
