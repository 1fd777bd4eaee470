"""The ODT pipeline: Hydra-configured stages over odt_ops, chained by DVC, tracked in MLflow.

One module per stage (prepare, convert, pretrain, generate, train, evaluate, export),
each with a pure ``run(cfg, paths) -> metrics`` and a ``main()`` that loads and
validates the configuration, opens the MLflow run and publishes the outputs.
"""
