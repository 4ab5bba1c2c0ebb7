"""Training the draft: the session, the loop, checkpoints, preemption and the report (stages/train.py
orchestrates them)."""
