"""Who is in the run: incarnation claims, leases, and how replicas left."""
