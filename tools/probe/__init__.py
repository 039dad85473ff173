"""Probes: runs that check the system holds up here (GPU, a real model, kills, a growing generator pool)."""
