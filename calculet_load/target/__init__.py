"""What the harness asks of the target besides requests: health/admin/trace API, /metrics
and process sampling, resources, network probes.
"""
