"""Judging parity: the comparator, the rules and bounds, the theory of known differences, pair verdicts (no runner: the session layer runs)."""
