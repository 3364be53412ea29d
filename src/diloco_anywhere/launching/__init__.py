"""From the user's machine: plan and start a run's replicas, watch them, and report,
export and provision what a run needs.
"""
