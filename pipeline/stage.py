"""What every stage's ``main()`` does around its ``run(cfg, paths, tracker)``.

1. load and validate the configuration (``pipeline.config.load``: params.yaml, plus the
   overrides of a hand run), before any work; Hydra's own flags are dispatched first
   (pipeline/config/hydra_flags.py: ``--cfg``/``--info``/``--hydra-help`` go to Hydra,
   ``-sc`` prints a completion script, ``--run`` runs, a sweep is refused with the DVC
   command, a flag that does not apply to a stage is refused in one line);
2. open the stage's MLflow run (``pipeline.tracking.stage_run``);
3. call ``run`` with the stage's output directory redirected to a staging directory,
   and swap it into ``data/<stage>/`` only if ``run`` succeeded, so a failure leaves
   the previous outputs (this stage's and every earlier one's) intact; the metrics file
   is rounded to the digits that mean something first, and the stage's headline metrics
   (``headline``: the few DVC shows) copied from it into headline.json, and the sha256 of
   every file recorded in SHA256SUMS (``pipeline.inputs.upstream`` checks a file a later
   stage reads against it: a changed bit is one line naming the file);
4. log the metrics and the output files (all, or the stage's ``artifacts(paths)``) to MLflow, then call the stage's
   ``after(cfg, paths, tracker)`` hook (PNG plots, files for the pipeline run) when
   tracking is on; a failing hook is a warning, never a failed stage;
5. report any error as one line on stderr (no traceback) and return its exit code:
   2 for configuration errors, 1 for bad inputs (data, model source, tracking store).

``python -m pipeline.<stage>`` executes the module as ``__main__``, a second copy beside
the ``pipeline.<stage>`` the configuration schema imports for its sections; their Enum
classes differ, so ``cfg.model.source is ModelSource.builtin`` would be false in the
copy. Each module's ``__main__`` block therefore calls the imported module's ``main``.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from pipeline.errors import EXIT_INPUT, PipelineError
from pipeline.paths import HEADLINE, METRICS, Paths

RunFn = Callable[..., dict]  # run(cfg, paths, tracker) -> metrics
SIGNIFICANT = 4  # digits kept in the metrics files DVC shows (dvc metrics show, dvc exp show)


def usage(stage: str) -> str:
    from pipeline.config import group_options

    groups = "\n".join(f"  {g}={'|'.join(opts)}" for g, opts in group_options().items())
    return (
        f"usage: python -m pipeline.{stage} [OVERRIDE ...]\n\n"
        "The stage runs what DVC would run (params.yaml) plus the overrides (Hydra grammar: key=value,\n"
        "+key=value, group=option; a group switch recomposes that group's section from conf/ and says so).\n"
        "Hydra's flags: --cfg job|hydra|all [--resolve] [-p KEY] prints the composed configuration, --info,\n"
        f"--hydra-help, --run (the default); tab completion: eval \"$(python -m pipeline.{stage} -sc install=bash)\";\n"
        "a sweep (-m, key=a,b) runs as DVC experiments: dvc exp run --queue -S 'key=a,b'.\n"
        f"Examples: python -m pipeline.{stage} optimizer.lr=3e-3 model=cnn\n"
        f"Outputs go to data/{stage}/ as under DVC (`dvc status` then shows them changed;\n"
        f"`git checkout -- data/{stage} && dvc checkout --force {stage}` restores DVC's).\n"
        "Exit codes: 2 bad configuration, 1 bad input.\n\n"
        f"Config groups:\n{groups}\n"
    )


def main(stage: str, run: RunFn, argv: Sequence[str] | None = None, *, artifacts: Callable[[Paths], Iterable[Path]] | None = None,
         after: Callable | None = None, describe: Callable[[dict], str] | None = None,
         datasets: Mapping[str, str] | None = None, headline: Mapping[str, str] | None = None) -> int:
    """Run ``stage`` as DVC or a person would (``python -m pipeline.<stage> [overrides]``)."""
    from odt_ops.errors import OdtError

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(usage(stage))
        return 0
    t0 = time.perf_counter()
    try:
        from pipeline import config, tracking
        from pipeline.config import hydra_flags
        from pipeline.io import publish_dir, write_digests

        exit_code, args = hydra_flags.dispatch(stage, args)  # Hydra's flags: shown, refused (ConfigError) or taken out
        if exit_code is not None:
            return exit_code
        cfg = config.load(args)
        note = config.recomposed(args)
        if note:
            print(f"{stage}: {note}", file=sys.stderr)
        paths = Paths.default()
        with tracking.stage_run(stage, cfg, config_source=config.source_of(args)) as tracker:
            with publish_dir(paths.out(stage)) as staging:
                metrics = run(cfg, paths.redirect(stage, staging), tracker)
                round_metrics_file(staging / METRICS)
                if headline:
                    write_headline(staging, headline)
                write_digests(staging)  # last: what later stages check the files they read against
            tracker.log_metrics(metrics)
            logged = artifacts(paths) if artifacts is not None else sorted(p for p in paths.out(stage).iterdir() if not p.name.startswith("."))
            for path in logged:
                tracker.log_artifact(path, stage)
            if datasets and tracker.enabled:  # the runs table's Dataset column: which splits this stage read
                _log_datasets(tracker, paths, datasets)
            if after is not None and tracker.enabled:
                try:
                    after(cfg, paths, tracker)
                except Exception as exc:  # plots and extras must not fail a stage whose outputs are published
                    print(f"{stage}: warning: extra tracking failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                          file=sys.stderr)
    except PipelineError as exc:
        print(f"{stage}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OdtError as exc:
        print(f"{stage}: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(f"{stage}: interrupted; earlier outputs are unchanged", file=sys.stderr)
        return 130
    shown = describe(metrics) if describe is not None else ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
    cpu = time.process_time()  # this process's CPU time since it started: imports and tracking included
    print(f"{stage}: done in {time.perf_counter() - t0:.1f} s ({cpu:.1f} s CPU) -> {paths.show(paths.out(stage))}/ ({shown})")
    return 0


def round_metrics_file(path: Path) -> None:
    """The stage's metrics file with every float rounded to SIGNIFICANT digits: what the
    numbers can say (one digit of a 300-digit holdout is 0.0033), and a file that does not
    change when arithmetic does in the last bits (0.30000000000000004 is 0.3)."""
    import json

    from pipeline.io import write_json

    if path.is_file():
        write_json(path, _rounded(json.loads(path.read_text(encoding="utf-8"))))


def write_headline(directory: Path, headline: Mapping[str, str]) -> Path:
    """``directory``'s headline.json: ``{name: metric}`` for each ``name -> key`` of
    ``headline`` (a flattened key of its metrics.json), what dvc.yaml lists as the stage's
    metrics: a few columns each, so ``dvc metrics show`` fits a terminal and ``dvc exp
    show`` stays readable; the detail stays in metrics.json and MLflow."""
    import json

    from pipeline.io import flatten, nest, write_json

    metrics = flatten(json.loads((directory / METRICS).read_text(encoding="utf-8")))
    write_json(directory / HEADLINE, nest({name: metrics[key] for name, key in headline.items()}))
    return directory / HEADLINE


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _log_datasets(tracker, paths: Paths, datasets: Mapping[str, str]) -> None:
    """``split name -> context`` (training, evaluation) as MLflow dataset inputs."""
    by_context: dict[str, dict] = {}
    for name, context in datasets.items():
        by_context.setdefault(context, {})[name] = (paths.split(name), paths.show(paths.split(name)))
    for context, group in by_context.items():
        tracker.log_datasets(group, context)


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
