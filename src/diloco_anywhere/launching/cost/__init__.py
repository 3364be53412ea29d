"""What a run costs and takes: prices, egress, traffic, round times, platform limits, the
estimate before it starts and the spend so far."""
