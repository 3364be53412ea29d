"""Keeping a run going: the keeper's passes (unattended, or following a launch in the
foreground), its decisions, the run's health and alerts."""
