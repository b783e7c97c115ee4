"""Thin CLI subcommands (probe, export, check-manifest, schema)."""
