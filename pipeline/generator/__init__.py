"""The generator core: one vLLM engine fed by the replay buffer, split into roles (core.py holds
the state machine and wires them; actors/generator.py adapts it to Monarch).

    core.py           GeneratorCore: the facade, its states, events and transitions
    engine.py         Engine (the vLLM AsyncLLM wrapper, LoRA adapters), Fault (the broken state)
    scheduler.py      StageScheduler: N' slots of a stage, carried partials first
    episode.py        Episodes: one trajectory's segments, environment turns, reward, reject or release
    scoring.py        Scoring (a base of Episodes): the reward, the reward model's score, the teacher's log-probs
    gate.py           UpdateGate: keep / abort / drain updates, the epoch that decides resubmission
    trajectory.py     Trajectory, version spans, request checks (pure)
    rewards.py        RewardScorer, RolloutStats, the reject-rate rule (pure)
    envs.py           the multi-turn environment interface and its token layout
    reward_client.py  the reward model's generator-side client
"""
