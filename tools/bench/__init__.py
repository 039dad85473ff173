"""Benchmarks: how fast one component is, each printing a table and writing it (and a plot) under --out."""
