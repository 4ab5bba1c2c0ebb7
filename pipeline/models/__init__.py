"""Model builders: the target (targets.py) and the EAGLE-3 draft (draft.py)."""
