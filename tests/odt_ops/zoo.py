"""The onnx wheel's zoo networks for the tests: odt_ops/zoo.py, which ``odt demo`` runs too."""
from odt_ops.zoo import randomize_weights, zoo_models, zoo_path

ZOO_MODELS = zoo_models()

__all__ = ["ZOO_MODELS", "randomize_weights", "zoo_path"]
