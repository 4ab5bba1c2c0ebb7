"""Tools (never part of stage=all, never fingerprinted): verify, serve, doctor, parity, check-store."""
