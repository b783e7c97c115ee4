"""Measuring one request: SSE parsing, protocol adapters, the timed client, durations, the
session, the Parquet sink, the self-watch, exact-length prompts.
"""
