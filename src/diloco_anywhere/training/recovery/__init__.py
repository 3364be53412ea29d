"""A replica brought back to the run: heals, its own saved state, checkpoint mirrors, and what
is written after each sync so that any of them can happen."""
