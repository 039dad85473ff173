"""Scripts a user runs by name, grouped by what they answer; each runs as `python -m tools.<group>.<name>`.

    bench/    how fast a component is (weight sync, generator, trainer, whole pipeline, rewards)
    compare/  what a choice changes in training (tasks, recipes, corrections, a peer framework)
    plan/     the planner: `python -m tools.plan simulate|calibrate|validate|recommend|papers`
    probe/    does it hold up on this machine (GPU check, real model, kills, elastic pool)
    build/    make artefacts runs read (a Qwen3 checkpoint, a reward model)
    lib/      what the tools share (launching the CLI, reading metrics.jsonl, tables and plots);
              no tool imports another tool
    slurm_standin/  executables put on PATH as a stand-in Slurm (tests/test_cluster.py)
    report.py `python -m tools.report`: the results book (docs/results) rebuilt from its data files
"""
