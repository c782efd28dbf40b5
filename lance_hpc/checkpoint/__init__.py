"""Saving and resuming: what a checkpoint holds, how each rank writes its part, and where."""
