"""The drivers and the command line of calculet-load: the top wing, above the library
(`calculet_load`) and the analysis (`analysis`), which it imports and neither of which
imports it (docs/architecture.md)."""
