"""The Locust integration, and the only code that imports Locust: plugin wiring, options,
worker, coordinator, distributed cells, shape, web UI, Prometheus, live statistics.
"""
