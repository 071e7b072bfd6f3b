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

.PHONY: install demo demo-marlin test test-fast default-model bench-gptq bench-scale clean help

help:
	@echo "make demo       quantize the embedded default model (RTN W4 g128, GPTQ format), print perplexity and KL"
	@echo "make test       the whole test suite (what CI runs)"
	@echo "make test-fast  the suite without tests marked slow"
	@echo "make demo-marlin  the marlin recipe end to end on Qwen2.5-Coder-0.5B (Marlin-legal shapes), KL vs RTN and GPTQ"
	@echo "make bench-gptq  RTN / GPTQ / P-GPTQ / S-P-GPTQ at W4 and W3 g128 on the default model, one table"
	@echo "make bench-scale  the marlin recipe on an 8B-shaped random MiniCPM4.1 checkpoint: time, memory, projection"
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

# The default model (hidden 576) cannot be Marlin-packed; Qwen2.5-Coder-0.5B (hidden 896, 2 KV heads) can.
MARLIN_MODEL ?= qwen2.5-coder-0.5b
DEMO_CALIB ?= calibration.n_samples=32
demo-marlin: $(INSTALLED)
	rm -rf $(OUT)/demo-marlin $(OUT)/demo-marlin.partial $(OUT)/demo-marlin-rtn $(OUT)/demo-marlin-gptq
	$(BIN)/quantkit quantize --recipe marlin --model $(MARLIN_MODEL) --out $(OUT)/demo-marlin --set $(DEMO_CALIB)
	$(BIN)/quantkit quantize --recipe rtn-w4g128 --model $(MARLIN_MODEL) --out $(OUT)/demo-marlin-rtn --set $(DEMO_CALIB)
	$(BIN)/quantkit quantize --recipe gptq-w4g128 --model $(MARLIN_MODEL) --out $(OUT)/demo-marlin-gptq --set $(DEMO_CALIB)
	for v in demo-marlin demo-marlin-gptq demo-marlin-rtn; do \
	  $(BIN)/quantkit eval kld --model $(OUT)/$$v --ref $(MARLIN_MODEL) --max-tokens 4096 || exit 1; done

bench-gptq: $(INSTALLED)
	$(BIN)/python -m quantkit.eval.bench_gptq --out $(OUT)/bench-gptq

bench-scale: $(INSTALLED)
	$(BIN)/python -m quantkit.eval.scale_8b --work $(OUT)/scale-8b

test: $(INSTALLED)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(OUT) build dist *.egg-info
