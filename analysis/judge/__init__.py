"""Rules as data and the verdicts they give."""
