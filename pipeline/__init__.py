"""The ODT pipeline: Hydra-configured stages over odt_ops, chained by DVC, tracked in MLflow.

One module per stage, named like its block in dvc.yaml (the only stage list: prepare,
convert, pretrain, generate, train, evaluate, export, federate), each with a pure
``run(cfg, paths, tracker) -> metrics`` and a ``main()`` (pipeline/stage.py) that loads and
validates the configuration, opens the MLflow run and publishes the outputs; ``retrain`` is
the scheduled job that reproduces the pipeline on new device data and promotes the result
when it does not regress (its lock and promotion store are pipeline/promotion.py).
"""
