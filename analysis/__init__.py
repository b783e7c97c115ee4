"""calculet-load analysis: reads run folders and turns records into verdicts and reports.

Never imports Locust or gevent, and reads files only (DESIGN §1). The statistics layer
(`analysis.stats`, `analysis.compare`, `analysis.leaks`) is pure: arrays in, dataclasses
out. The pipeline of `calculet-load analyze` (docs/analysis.md), in data-flow order:
`load` (files → Arrow) → `join` (server traces, device rows) → `quality` (exclusions,
partitions) → `cells` and `summary` (per-cell statistics) → `rules` (the rules file) →
`evaluate` with `infra`, `correctness`, `comparisons`, `limits`, `capacity`, `batch`,
`resources` (verdicts; and the §7/§14.3/§13 sections) → `verdict` (exit code,
verdict.json) — orchestrated by `analyze`, fronted by `cli`; `legacy` imports the old
CSV as a trend only. Import the submodules directly; this package imports nothing heavy.
"""

__all__: list[str] = []
