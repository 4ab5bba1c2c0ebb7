"""evaluate's two benches, one entry shape: offline (local target + reference draft) and online (a server)."""
