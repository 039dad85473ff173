"""What the tools share: cli (launch `python -m pipeline.run` or another module, to a log, with a
timeout, returning the exit code), metrics (a run's metrics.jsonl as step and eval rows, its summary),
report (Markdown tables, figures, curves over steps), and the measuring pieces more than one tool
drives: sources (prompt sources for a generator proc), push (a push overlapping a train step),
ranks (the sharded push over N trainer-rank procs)."""
