"""calculet-load analysis: reads run folders and turns records into verdicts and reports.

Never imports Locust or gevent, and reads files only (DESIGN §1). Four layers, each
importing only those before it (docs/architecture.md):

- `analysis.stats`: pure statistics, arrays in and dataclasses out (quantiles and their
  intervals, the paired comparison, trends);
- `analysis.tables`: the run folder as tables: `load` (files → Arrow), `join` (server
  traces, device rows), `quality` (exclusions, partitions), `tokens`, `cells` and
  `summary` (per-cell statistics);
- `analysis.judge`: `rules` (the rules file) evaluated into verdicts by `evaluate` with
  `infra`, `correctness`, `comparisons`, `limits`, `capacity`, `batch`, `resources`,
  `boundary`, and `verdict` (exit code, verdict.json);
- `analysis.views`: the report's sections (view models and plots).

At the root: `analyze` (the orchestration), `report`, `sign`, `cli`, `legacy` (the old
CSV as a trend only). Import the submodules directly; this package imports nothing heavy.
"""

__all__: list[str] = []
