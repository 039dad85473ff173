"""TeacherActor: on-policy distillation's teacher (pipeline/teacher.py) on its own mesh.

The reward model's actor (actors/reward_model.py) with a causal LM behind it: the same protocol,
one FIFO queue served by one worker, streams' chunks batched into padded forwards, a prefix cache
per rollout, release on reject. `finish` answers the stream's per-token log-probs:

    t = procs.spawn("teacherr0", TeacherActor, cfg, 0)
    info = await t.setup.call_one()                          # placement, then the model
    await t.prefill.call_one(seq, 0, teacher_prompt + chunk) # queued; answers at once
    r = await t.finish.call_one(seq, offset, last_chunk)     # {"teacher": {"logprobs": [...], "top1": [...]}} | {"lost": True} | {"error": why}
    await t.release.call_one([seq]); await t.release_prefix.call_one("g1r0/")
    await t.stats.call_one()

teacher.hf_dir=self loads the student's initial checkpoint (model.hf_dir).
"""

from __future__ import annotations

from actors.reward_model import RewardModelActor
from pipeline.placement import teacher_placement

__all__ = ["TeacherActor"]


class TeacherActor(RewardModelActor):
    RESULT = "teacher"

    def _placement(self):
        return teacher_placement(self.cfg)

    def _load(self):
        import torch

        from pipeline.models.hf import model_dir
        from pipeline.config.teacher import SELF
        from pipeline.teacher import TeacherScorer

        tc = self.cfg.teacher
        path = model_dir(self.cfg.model) if tc.hf_dir == SELF else tc.hf_dir
        device = "cuda" if tc.device == "cuda" else "cpu"
        return TeacherScorer(path, device, getattr(torch, tc.dtype), tc.max_sequences, tc.max_batch,
                             self.cfg.generator.temperature)
