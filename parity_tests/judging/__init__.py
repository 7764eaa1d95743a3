"""Judging parity: the comparator, the tolerance model, the theory of known differences, the judge."""
