"""Experiments over many runs: sweeps, reports with paired verdicts, in-process federations for notebooks."""
