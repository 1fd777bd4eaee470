"""The pipeline's configuration: conf/ (Hydra groups) composed into params.yaml, loaded
and validated into a typed ``Config`` before any stage works.

- ``schema``: the building blocks (``Section``, ``MISSING``, ``LOSS`` and ``OPTIMIZER``
  block nodes) and the ``Config`` collected from the sections their owners declare;
- ``load``: where a stage's configuration comes from, and validation;
- ``messages``: one line per error, naming the key and what it allows.
"""
from pipeline.config.load import compose, compose_yaml, group_options, group_switches, load, main, recomposed, source_of, to_container, validate
from pipeline.config.schema import LOSS, MISSING, OPTIMIZER, Section, build
from pipeline.errors import ConfigError

__all__ = ["LOSS", "MISSING", "OPTIMIZER", "ConfigError", "Section", "build", "compose", "compose_yaml", "group_options", "group_switches", "load",
           "main", "recomposed", "source_of", "to_container", "validate"]
