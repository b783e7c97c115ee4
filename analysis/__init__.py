"""calculet-load analysis: reads run folders and turns records into verdicts and reports.

Never imports Locust or gevent, and reads files only (DESIGN §1). The statistics layer
(`analysis.stats`, `analysis.compare`, `analysis.leaks`) is pure: arrays in, dataclasses
out. Import the submodules directly; this package imports nothing heavy.
"""

__all__: list[str] = []
