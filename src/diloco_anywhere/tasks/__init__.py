"""Built-in tasks (see diloco_anywhere.task)."""
