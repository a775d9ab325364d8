# make demo   train llama-tiny under several strategies on 8 simulated CPU devices
# make demo-text  train llama-tiny on the standard library's .py files (text in, held-out loss, text out)
# make test   the test suite (8 simulated CPU devices; two pytest workers, one test file each at a time)
# make test-slow  the slow tests (-m slow), which CI runs after make test
# make bench  print throughput / memory / speed figures (no assertions)
# make experiments  run every study of the design guide (experiments/README.md) in full mode
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-text test test-slow bench experiments clean

$(STAMP): pyproject.toml
	@PYTHON=$$(bash scripts/find-python.sh) || exit 1; \
	  echo "using $$PYTHON ($$($$PYTHON --version))"; \
	  [ -x $(PY) ] || $$PYTHON -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,plot,tensorboard,tpu-aot]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) experiments/demo.py

demo-text: $(STAMP)
	$(PY) experiments/demo_text.py

test: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder; rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s wall (goal: under 600 s on 2 cores)"; exit $$rc

test-slow: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m slow; rc=$$?; \
	  echo "make test-slow: $$(( $$(date +%s) - start )) s wall"; exit $$rc

bench: $(STAMP)
	$(PY) experiments/demo.py --model llama-tiny:layers=8 --meshes all --steps 20
	@for f in experiments/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

experiments: $(STAMP)
	@start=$$(date +%s); for f in experiments/study_*.py; do \
	  t=$$(date +%s); echo "== $$f"; $(PY) $$f || exit 1; echo "   $$(( $$(date +%s) - t )) s"; done; \
	  echo "make experiments: $$(( $$(date +%s) - start )) s wall (goal: under 1800 s on 2 cores)"

clean:
	rm -rf $(VENV) .pytest_cache
