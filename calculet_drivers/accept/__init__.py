"""The §15 acceptance pipeline, interleaved A/B, the §14.3 capacity search and the demo."""
