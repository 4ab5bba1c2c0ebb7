"""SLURM: the pipeline as a job graph of batch jobs, and what SLURM is asked (issue #38)."""
