"""The §13 soak and endurance stages: stage files, the run and its load and samplers,
resumable state, judgement."""
