"""The bucket collective: a weighted-mean all-reduce through create-only objects.

Protocol: docs/collective.md.
"""
