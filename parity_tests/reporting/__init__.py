"""Reporting: ``report.md``/``report.json``/plots, the scenario matrix, generated reference pages."""
