"""Composition: the Ray Data job and its stages, `ask`, evaluation, training, the report and the
command line, built from `operators` (one record) and `connectors` (everything outside)."""
