"""Reading a run folder into tables: load, join, quality filters, token events, per-cell
figures.
"""
