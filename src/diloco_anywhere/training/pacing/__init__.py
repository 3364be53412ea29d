"""How much a replica trains each round: the pace, and the units of the run's data it claims."""
