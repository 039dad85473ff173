"""Comparisons: whole CLI runs side by side (tasks, recipes, corrections, TRL), with tables and curves."""
