"""Pure statistics: arrays in, dataclasses out (quantiles and intervals, paired comparison,
trends).
"""
