"""The trainer core of one rank, torch only (actors/trainer.py wraps it in Monarch):

    step.py       TrainCore: the RL step (PPO minibatches, the loss), the SFT step, clip-and-step,
                  skipped steps; the counters a checkpoint carries
    batches.py    minibatch_rows / minibatch_plan (a step's minibatches and micro-batches), spans,
                  logprobs
    parallel.py   Parallel: the (fsdp, tp) mesh, the model built on it (float32 master, compute in
                  model.dtype), the TP-aware grad norm and clip, the metric all-reduces
    snapshots.py  Proximal (π_old of a batch), GradChunks (trainer.grad_variance), Snapshots
                  (mis_balance's copies of earlier versions' weights)
    state.py      TrainerState: KL reference, HF weights and export, DCP checkpoints, RNG
    checks.py     the input checks before a batch touches the weights
    errors.py     the errors the driver tells apart (skipped step or fatal)

Example:
    core = TrainCore.from_config(cfg, rank, world)
    metrics = core.train_step(batch)
    core.state.export_hf(out_dir)
"""
