"""The §12 fault matrix: scenarios as data, actions, judgement, maintenance windows."""
