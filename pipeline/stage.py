"""What every stage's ``main()`` does around its ``run(cfg, paths, tracker)``.

1. load and validate the configuration (``pipeline.config.load``), before any work;
2. open the stage's MLflow run (``pipeline.tracking.stage_run``);
3. call ``run`` with the stage's output directory redirected to a staging directory,
   and swap it into ``data/<stage>/`` only if ``run`` succeeded, so a failure leaves
   the previous outputs (this stage's and every earlier one's) intact;
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

import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from pipeline.errors import EXIT_INPUT, PipelineError
from pipeline.paths import Paths

RunFn = Callable[..., dict]  # run(cfg, paths, tracker) -> metrics


def usage(stage: str) -> str:
    from pipeline.config import group_options

    groups = "\n".join(f"  {g}={'|'.join(opts)}" for g, opts in group_options().items())
    return (
        f"usage: python -m pipeline.{stage} [OVERRIDE ...]\n\n"
        "With no overrides the stage reads params.yaml (as DVC runs it); with overrides it\n"
        "composes conf/ plus the overrides (Hydra grammar: key=value, group=option, +key=value).\n"
        f"Examples: python -m pipeline.{stage} optimizer.lr=3e-3 model=cnn\n"
        f"Outputs go to data/{stage}/ as under DVC (`dvc status` then shows them changed;\n"
        "`dvc checkout` restores DVC's). Exit codes: 2 bad configuration, 1 bad input.\n\n"
        f"Config groups:\n{groups}\n"
    )


def main(stage: str, run: RunFn, argv: Sequence[str] | None = None, *, artifacts: Callable[[Paths], Iterable[Path]] | None = None,
         after: Callable | None = None, describe: Callable[[dict], str] | None = None,
         datasets: Mapping[str, str] | None = None) -> int:
    """Run ``stage`` as DVC or a person would (``python -m pipeline.<stage> [overrides]``)."""
    from odt_ops.errors import OdtError

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(usage(stage))
        return 0
    t0 = time.perf_counter()
    try:
        from pipeline import config, tracking
        from pipeline.io import publish_dir

        cfg = config.load(args)
        paths = Paths.default()
        with tracking.stage_run(stage, cfg, config_source=config.source_of(args)) as tracker:
            with publish_dir(paths.out(stage)) as staging:
                metrics = run(cfg, paths.redirect(stage, staging), tracker)
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
    print(f"{stage}: done in {time.perf_counter() - t0:.1f} s -> {paths.show(paths.out(stage))}/ ({shown})")
    return 0


def _log_datasets(tracker, paths: Paths, datasets: Mapping[str, str]) -> None:
    """``split name -> context`` (training, evaluation) as MLflow dataset inputs."""
    from pipeline.training import load_split

    by_context: dict[str, dict] = {}
    for name, context in datasets.items():
        by_context.setdefault(context, {})[name] = (load_split(paths, name).x, paths.show(paths.split(name)))
    for context, group in by_context.items():
        tracker.log_datasets(group, context)


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
