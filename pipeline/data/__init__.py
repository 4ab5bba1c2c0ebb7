"""Data in: conversation sources, regeneration by the target, the training dataset over the store."""
