"""Watching a run and taking its results out: status, the status page, reports, trackers,
export."""
