"""The §13 soak and endurance stages: stage definitions, resumable state, judgement, the run."""
