"""One replica's training: torchft's DiLoCo over the bucket-backed manager, healing,
global checkpoints and their mirrors, metrics, and the public API a training script uses.
"""
