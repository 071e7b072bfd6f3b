# quantkit: every target creates and reuses .venv. Torch comes first, from $(TORCH), so that pip never
# resolves an unpinned torch to a multi-GB CUDA build; override it for your platform, e.g.
#   make test TORCH='torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu'
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
OUT ?= out
PYTEST_ARGS ?=
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install demo test test-fast default-model clean help

help:
	@echo "make demo       quantize the embedded default model (RTN W4 g128, GPTQ format), print perplexity and KL"
	@echo "make test       the whole test suite (what CI runs)"
	@echo "make test-fast  the suite without tests marked slow"
	@echo "make default-model  fetch and convert the default model into the cache"
	@echo "make install    create .venv with quantkit and its test extra"

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH)
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

install: $(INSTALLED)

default-model: $(INSTALLED)
	$(BIN)/quantkit default-model

demo: $(INSTALLED)
	rm -rf $(OUT)/demo-rtn-w4g128 $(OUT)/demo-rtn-w4g128.partial
	$(BIN)/quantkit quantize --recipe rtn-w4g128 --model default --out $(OUT)/demo-rtn-w4g128
	$(BIN)/quantkit eval ppl --model default
	$(BIN)/quantkit eval ppl --model $(OUT)/demo-rtn-w4g128
	$(BIN)/quantkit eval kld --model $(OUT)/demo-rtn-w4g128 --ref default

test: $(INSTALLED)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(OUT) build dist *.egg-info
