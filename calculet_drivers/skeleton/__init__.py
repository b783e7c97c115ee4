"""What the drivers (faults, soak, accept) share: steps with a typed context and an
outcome, the run's event log, and the client they send through."""
