"""What to send and when: arrival shapes, matrices, mixes, and the one dispatcher every
open-loop driver uses.
"""
