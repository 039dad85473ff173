"""vLLM general plugin (entry point `vllm.general_plugins: monarch_rl_weight_transfer`).

vLLM calls `register()` in every engine and worker process it starts, so the `monarch_rl`
weight-transfer backend exists wherever `weight_transfer_config={"backend": "monarch_rl"}` is used,
and the engine core dies with the process that started it (pipeline.cleanup.exit_with_parent).
It also drops the benign vLLM messages at the generator's run.log_level (pipeline.logs.quiet_benign).
The package must be installed (`pip install --no-deps -e .`) for the entry point to be visible.
"""

from __future__ import annotations

BACKEND = "monarch_rl"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from pipeline.cleanup import exit_with_parent
    from pipeline.logs import quiet_benign

    exit_with_parent()
    quiet_benign()

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "pipeline.weightsync.vllm_engine",
                                                    "MonarchRLWeightTransferEngine")
    except ValueError as e:  # vLLM may load plugins more than once per process
        if "already registered" not in str(e):
            raise
