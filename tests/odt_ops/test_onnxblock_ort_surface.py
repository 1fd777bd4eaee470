"""onnxblock and generate_artifacts as ONNX Runtime users call them: custom TrainingBlock and
ForwardBlock graphs, optimizer blocks called on parameters, gradient clipping, the onnxblock
checkpoint helpers, and the options we accept but cannot honour. PyTorch autograd and
onnxruntime's inference build are the oracles."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from odt_ops import artifacts, onnxblock
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import ArtifactError, InputError

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _export(net, x) -> onnx.ModelProto:
    import io

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), buffer, input_names=["x"], output_names=["logits"], opset_version=14,
                          dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}}, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def _loss_on_top(base_block, loss):
    """A block as ORT users write one: a loss built on the model's output."""
    class LossOnTop(base_block):
        def __init__(self):
            super().__init__()
            self.loss = loss()

        def build(self, output_name):
            return self.loss(output_name)

    return LossOnTop


CrossEntropyTraining = _loss_on_top(onnxblock.TrainingBlock, onnxblock.loss.CrossEntropyLoss)


def _built(net, x, trained, frozen=()):
    """A CrossEntropyTraining block built on ``net``'s export, ``trained`` marked to train."""
    block = CrossEntropyTraining()
    for name in trained:
        block.requires_grad(name)
    for name in frozen:
        block.requires_grad(name, False)
    base = _export(net, x)
    with onnxblock.base(base):
        block(base.graph.output[0].name)
    return block


@pytest.fixture
def net_and_data():
    torch.manual_seed(0)
    net = TwoLayer()
    x, y = torch.randn(6, 12), torch.randint(0, 3, (6,))
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    return net, x, y, loss.item()


def _ort(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_custom_training_block_gives_pytorch_gradients_with_ort_accumulation(net_and_data):
    net, x, y, want_loss = net_and_data
    block = _built(net, x, [name for name, _ in net.named_parameters()])
    training, evaluation = block.to_model_proto()
    trainable, frozen = block.parameters()
    assert [t.name for t in trainable] == [n for n, _ in net.named_parameters()]
    assert not frozen

    # onnxruntime runs the training graph with ONNX Runtime's accumulation inputs and outputs
    feeds = {training.graph.input[0].name: x.numpy(), training.graph.input[1].name: y.numpy()}
    previous = {}
    for name, p in net.named_parameters():
        feeds[name] = p.detach().numpy()
        previous[name] = np.full(p.shape, 0.5, np.float32)
        feeds[f"{name}_grad.accumulation.buffer"] = previous[name]
    names = [n for n, _ in net.named_parameters()]
    for reset in (True, False):
        feeds["lazy_reset_grad"] = np.array([reset])
        outs = _ort(training).run([training.graph.output[0].name, *(f"{n}_grad.accumulation.out" for n in names)], feeds)
        np.testing.assert_allclose(outs[0], want_loss, rtol=1e-5)
        for name, got in zip(names, outs[1:]):
            grad = dict(net.named_parameters())[name].grad.numpy()
            np.testing.assert_allclose(got, grad if reset else previous[name] + grad, rtol=1e-4, atol=1e-6)
    (eval_loss,) = _ort(evaluation).run([evaluation.graph.output[0].name],
                                        {k: v for k, v in feeds.items() if k in {i.name for i in evaluation.graph.input}})
    np.testing.assert_allclose(eval_loss, want_loss, rtol=1e-5)


def test_a_custom_training_block_trains_in_our_module_from_its_onnxblock_checkpoint(tmp_path, net_and_data):
    net, x, y, want_loss = net_and_data
    block = _built(net, x, ["fc2.weight", "fc2.bias"], frozen=["fc1.weight", "fc1.bias"])
    training, evaluation = block.to_model_proto()
    onnx.save(training, tmp_path / "training_model.onnx")
    onnx.save(evaluation, tmp_path / "eval_model.onnx")
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "checkpoint")
    optimizer = onnxblock.optim.SGD()
    with onnxblock.empty_base() as accessor:
        optimizer(block.parameters())
        onnx.save(accessor.model, tmp_path / "optimizer_model.onnx")

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    module.train()
    np.testing.assert_allclose(module(x.numpy(), y.numpy()), want_loss, rtol=1e-5)
    np.testing.assert_allclose(state.parameters["fc2.weight"].grad, net.fc2.weight.grad.numpy(), rtol=1e-4, atol=1e-6)
    assert state.parameters["fc1.weight"].grad is None
    opt.set_learning_rate(0.1)
    opt.step()
    np.testing.assert_allclose(state.parameters["fc2.weight"].data,
                               (net.fc2.weight - 0.1 * net.fc2.weight.grad).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_load_checkpoint_to_model_writes_the_trained_values_into_the_forward_model(tmp_path, net_and_data):
    net, x, _, _ = net_and_data
    block = _built(net, x, [name for name, _ in net.named_parameters()])
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "checkpoint")
    with torch.no_grad():
        zeroed = TwoLayer()
        for p in zeroed.parameters():
            p.zero_()
    target = _export(zeroed, x)
    onnxblock.load_checkpoint_to_model(tmp_path / "checkpoint", target)
    np.testing.assert_allclose(_ort(target).run(None, {"x": x.numpy()})[0], net(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="allow_unused"):
        onnxblock.load_checkpoint_to_model(tmp_path / "checkpoint", onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])))


def test_a_forward_block_is_the_model_with_its_output(net_and_data):
    net, x, _, _ = net_and_data

    block = _loss_on_top(onnxblock.ForwardBlock, onnxblock.loss.MSELoss)()
    base = _export(net, x)
    before = base.SerializeToString()
    with onnxblock.base(base) as accessor:
        # ONNX Runtime's base builds into a deep copy of the model (onnxblock/model_accessor.py)
        assert accessor.model is not base and accessor.model == base
        out = block(base.graph.output[0].name)
    assert base.SerializeToString() == before  # the caller's model as it was, so it can be built on again
    assert out in {o.name for o in accessor.model.graph.output} | {n for node in accessor.model.graph.node for n in node.output}
    model = block.to_model_proto()
    assert [o.name for o in model.graph.output] == [out]
    target = torch.randn(6, 3)
    got = _ort(model).run(None, {model.graph.input[0].name: x.numpy(), model.graph.input[1].name: target.numpy()})[0]
    np.testing.assert_allclose(got, torch.nn.functional.mse_loss(net(x), target).item(), rtol=1e-5)


def test_clip_grad_norm_matches_pytorch(net_and_data):
    net, _, _, _ = net_and_data
    grads = [p.grad.numpy().copy() for p in net.parameters()]
    names = [f"g{i}" for i in range(len(grads))]

    class Clip(onnxblock.ForwardBlock):
        def build(self, *gs):
            return onnxblock.optim.ClipGradNorm(0.05)(*gs)

    base = onnx.helper.make_model(onnx.helper.make_graph(
        [], "clip", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(g.shape)) for n, g in zip(names, grads)], []),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    block = Clip()
    with onnxblock.base(base):
        block(*names)
    clipped = _ort(block.to_model_proto()).run(None, dict(zip(names, grads)))
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
    for got, p in zip(clipped, net.parameters()):
        np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-5, atol=1e-8)
    assert onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(2.5)).max_norm == 2.5
    assert onnxblock.optim.SGD(clip_grad=onnxblock.optim.ClipGradNorm(1.0)).hyperparameters()["max_norm"] == 1.0


def test_parameters_before_building_name_the_fix():
    with pytest.raises(ArtifactError, match="Please build the training model first"):
        CrossEntropyTraining().parameters()


@pytest.mark.parametrize("option", [{"ort_format": True}, {"custom_op_library": "libcustom.so"}])
def test_options_we_cannot_honour_are_refused_by_name_before_anything_is_written(tmp_path, option, net_and_data):
    net, x, _, _ = net_and_data
    with pytest.raises(ArtifactError, match=next(iter(option))):
        artifacts.generate_artifacts(_export(net, x), requires_grad=["fc2.weight"], loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path, **option)
    assert not any(tmp_path.iterdir())
    artifacts.generate_artifacts(_export(net, x), requires_grad=["fc2.weight"], loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path, ort_format=False, custom_op_library=None)


def test_module_takes_ort_arguments_and_orders_inputs_as_ort(tmp_path, net_and_data):
    net, x, y, _ = net_and_data
    artifacts.generate_artifacts(_export(net, x), requires_grad=["fc1.weight", "fc2.weight"], frozen_params=["fc1.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    with pytest.raises(InputError, match="device"):
        Module(tmp_path / "training_model.onnx", state, device="cuda")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx", device="cpu",
                    session_options=ort.SessionOptions())
    training = onnx.load(tmp_path / "training_model.onnx")
    assert module.input_names() == [i.name for i in training.graph.input][:2] == ["x", module.input_names()[1]]
    assert module.output_names() == [o.name for o in training.graph.output][:1]
    loss = module(ort.OrtValue.ortvalue_from_numpy(x.numpy()), ort.OrtValue.ortvalue_from_numpy(y.numpy()))
    assert isinstance(loss, ort.OrtValue)  # given OrtValues, answered in kind
    flat = module.get_contiguous_parameters()
    module.copy_buffer_to_parameters(ort.OrtValue.ortvalue_from_numpy(flat.numpy() * 2), trainable_only=False)
    np.testing.assert_array_equal(module.get_contiguous_parameters(), flat * 2)


def test_a_training_block_can_ask_for_the_gradient_of_an_input(net_and_data):
    """requires_grad on a graph input (saliency, adversarial examples): its gradient is an output,
    with ONNX Runtime's accumulation names, equal to torch's x.grad."""
    net, x, y, _ = net_and_data
    training, _ = _built(net, x, ["fc2.weight", "x"]).to_model_proto()
    assert "x_grad.accumulation.buffer" in {i.name for i in training.graph.input}
    feeds = {"x": x.numpy(), training.graph.input[1].name: y.numpy(), "lazy_reset_grad": np.array([True]),
             "x_grad.accumulation.buffer": np.zeros_like(x.numpy()), "fc2.weight_grad.accumulation.buffer": np.zeros((3, 8), np.float32)}
    feeds.update({i.name: p.detach().numpy() for i in training.graph.input for n, p in net.named_parameters() if i.name == n})
    (got,) = _ort(training).run(["x_grad.accumulation.out"], feeds)
    tx = x.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(net(tx), y).backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-4, atol=1e-7)


def test_the_onnx_runtime_1_14_names_of_the_android_example_flow(tmp_path):
    """ORT's published Android example still prepares its assets with 1.14's names:
    onnxblock.TrainingModel, `with onnxblock.onnx_model(model) as accessor` and
    accessor.eval_model, an optimizer built in `onnxblock.onnx_model()`, save_checkpoint.
    The files it writes train here, with PyTorch's loss and gradients."""
    class SmallConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4 * 3 * 3, 5)

        def forward(self, x):
            return self.fc(torch.flatten(torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2), 1))

    torch.manual_seed(0)
    net = SmallConvNet()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    import io

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), buffer, input_names=["input"], output_names=["output"], opset_version=14,
                          dynamic_axes={"input": {0: "batch_size"}, "output": {0: "batch_size"}},
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
    model = onnx.load_from_string(buffer.getvalue())

    class ImageClassifier(onnxblock.TrainingModel):
        def __init__(self):
            super().__init__()
            self._loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, input_name):
            return self._loss(input_name)

    classifier = ImageClassifier()
    for name, _ in net.named_parameters():
        classifier.requires_grad(name)
    with onnxblock.onnx_model(model) as accessor:
        classifier(model.graph.output[0].name)
        eval_model = accessor.eval_model
    onnx.save(model, tmp_path / "training_model.onnx")
    onnx.save(eval_model, tmp_path / "eval_model.onnx")
    with onnxblock.onnx_model() as accessor:
        onnxblock.optim.AdamW(clip_grad=None)(classifier.parameters())
        onnx.save(accessor.model, tmp_path / "optimizer.onnx")
    onnxblock.save_checkpoint(classifier.parameters(), tmp_path / "checkpoint")

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    Optimizer(tmp_path / "optimizer.onnx", module)
    loss = module(x.numpy(), y.numpy())
    want = torch.nn.functional.cross_entropy(net(x), y)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    np.testing.assert_allclose(state.parameters["conv.weight"].grad, net.conv.weight.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_a_training_block_returning_loss_and_output_as_ort_desktop_mnist_does(tmp_path, net_and_data):
    """ORT's desktop MNIST example: ``build`` returns ``(self.loss(output_name), output_name)``; the
    training and eval models put the output out after the loss (onnxruntime runs both) and
    Module returns [loss, output]: PyTorch's loss, logits and gradients."""
    net, x, y, want_loss = net_and_data

    class MNISTTrainingBlock(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, output_name):
            return self.loss(output_name), output_name

    block = MNISTTrainingBlock()
    for name, _ in net.named_parameters():
        block.requires_grad(name)
    base = _export(net, x)
    with onnxblock.base(base) as accessor:
        loss_name, output_name = block("logits")
        eval_model = accessor.eval_model
    training, evaluation = block.to_model_proto()
    assert output_name == "logits"
    assert [o.name for o in training.graph.output][:2] == [loss_name, "logits"]
    assert [o.name for o in evaluation.graph.output] == [loss_name, "logits"]
    assert eval_model is evaluation
    logits = net(x).detach().numpy()
    params = {n: p.detach().numpy() for n, p in net.named_parameters()}
    y_name = evaluation.graph.input[1].name
    got_loss, got_logits = _ort(evaluation).run([loss_name, "logits"], {"x": x.numpy(), y_name: y.numpy(), **params})
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_logits, logits, rtol=1e-5, atol=1e-6)

    onnx.save(training, tmp_path / "training_model.onnx")
    onnx.save(evaluation, tmp_path / "eval_model.onnx")
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "checkpoint")
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    assert module.output_names() == [loss_name, "logits"]
    train_loss, train_logits = module(x.numpy(), y.numpy())
    np.testing.assert_allclose(train_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(train_logits, logits, rtol=1e-5, atol=1e-6)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    module.eval()
    eval_loss, eval_logits = module(x.numpy(), y.numpy())
    np.testing.assert_allclose(eval_logits, logits, rtol=1e-5, atol=1e-6)
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    (exported,) = _ort(onnx.load(tmp_path / "inference.onnx")).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(exported, logits, rtol=1e-5, atol=1e-6)


def test_a_training_block_returning_no_name_says_what_it_takes(net_and_data):
    net, x, _, _ = net_and_data

    class Nothing(onnxblock.TrainingBlock):
        def build(self, output_name):
            return ()

    base = _export(net, x)
    with pytest.raises(ArtifactError, match=r"must return the loss's name, or \(loss, \*extra outputs\)"), onnxblock.base(base):
        Nothing()("logits")
