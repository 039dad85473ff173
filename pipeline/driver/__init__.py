"""The driver: the controller process of a run, as roles (see each module's docstring).

    job.py           Job: the roles of one run, started and stopped together (trainer, buffer, fleet, sync)
    loop.py          TrainLoop (batch -> train -> publish -> hooks), the publish strategies, run(cfg, host)
    hooks.py         what runs after each step: metrics, eval, checkpoints, the rollout log
    fleet.py         MeshSlot (one actor on its own proc) and Fleet (the generators and the reward model)
    supervisor.py    Supervisor: one failure queue, one restart algorithm for every slot
    rewiring.py      what a restart does around a slot, per kind (generator, reward model)
    pool.py          Pool: generators added and removed while the run goes on (pipeline/control.py drives it)
    checkpointing.py save at a step, save a last checkpoint after a failure, resume
    shutdown.py      close -> cancel -> stop, bounded, never raising over the run's own error
    evaluation.py    held-out eval on a generator
    warm_start.py    supervised warm start on task demonstrations
    calls.py         RunError, EndOfData and the bounded call helper every role uses
    torchrun.py      one Monarch job over torchrun's ranks (rank 0 drives it)
    health.py metrics.py wandb_sink.py   batch health and collapse watch; metrics.jsonl, TensorBoard, W&B
"""
