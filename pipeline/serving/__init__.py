"""Serving an export: its launch lines and serve.sh (launch.py), a server started and stopped as its own
process
group (server.py), and the sweep of speculative settings that picks serve.sh's by measurement (sweep.py)."""
