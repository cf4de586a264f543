# The two commands a newcomer needs: `make run` and `make test`.
# Both create/refresh .venv when pyproject.toml changes.
#   make run                      the whole stack on this CPU machine (edge on :8000)
#   make run ARGS="--port 9000"   flags go to `pdserve up` (docs/configuration.md)
#   make test                     stale-stub check, Debian test servers, the whole suite
#   make clients                  the third-party clients tests/e2e/test_clients.py runs
#   make bench-clients            the benchmark tools `pdserve bench external` runs
#   make proto                    regenerate gRPC stubs after editing proto/
#   make lock                     resolve lock/*.txt again after editing pyproject.toml's pins
#   make image [EXTRAS=gpu]       the image (docker, podman or buildah); make image-test runs it
SHELL := /bin/bash
PYTHON ?= python3
EXTRAS ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRAS)
NATIVE := $(VENV)/.native

.PHONY: run test proto check-proto system-deps clients bench-clients clean lock lock-clients image \
	image-test

# .venv holds exactly lock/$(EXTRAS)-dev.txt (scripts/install_lock.sh), then pdserve itself.
LOCK := lock/$(EXTRAS)-dev.txt
$(STAMP): pyproject.toml setup.py $(LOCK) scripts/install_lock.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	scripts/install_lock.sh $(PY) $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The C parts (setup.py: the router's placement core, the edge's byte-level detokenizer),
# rebuilt in place when their source changes; without a compiler the router runs the
# Python reference and the edge the tokenizer's DecodeStream (pdserve/native.py).
$(NATIVE): $(STAMP) services/router/_placement.c services/edge/_bytetext.c
	$(PY) setup.py -q build_ext --inplace
	touch $(NATIVE)

run: $(STAMP) $(NATIVE)
	$(VENV)/bin/pdserve up $(ARGS)

# What the suite needs, made side by side (downloads and unpacking, mostly), then the suite.
# PDSERVE_NATIVE=require: a C part that did not build fails the suite (every process it
# starts inherits it) instead of passing on the Python reference unseen.
# Bytecode: written at a module's first import, under .venv/pycache, and read by every
# later process, even where PYTHONDONTWRITEBYTECODE is set (CI): there each of the suite's
# ~100 processes compiled vLLM and torch again (an engine's imports: 65 s, not 13). Only
# what runs is compiled (all of site-packages would take 60 s); the source tree gets none.
PYCACHE := $(abspath $(VENV))/pycache
test:
	$(MAKE) --no-print-directory -j4 $(STAMP) $(NATIVE) check-proto system-deps clients
	env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(PYCACHE) PDSERVE_NATIVE=require \
		$(PY) -m pytest -q $(PYTEST_ARGS)

# Clients written by others that tests/e2e/test_clients.py runs unmodified, each installed
# where it cannot move .venv's pins (guidellm's click and multidict would): guidellm in its
# own venv, the OpenAI JS SDK under node. Both from lock files, installed exactly (--no-deps,
# npm ci); each rule runs again only when its lock changes. Nothing here is remade when .venv
# is (guidellm needs one, for torch), so the tests can run `make clients` themselves.
CLIENTS := .venv-clients
GUIDELLM := $(CLIENTS)/guidellm
NODE_CLIENTS := tests/e2e/clients
clients: $(GUIDELLM)/.installed $(NODE_CLIENTS)/node_modules/.installed

# guidellm, inference-perf and aiperf for `pdserve bench external` (which runs this), not
# for the suite: no test runs the last two (12-15 s each to install, 0.6 and 0.9 GB). Each
# from its lock alone, neither needs torch; inference-perf needs Python >= 3.12.
bench-clients: $(GUIDELLM)/.installed $(CLIENTS)/inference-perf/.installed \
	$(CLIENTS)/aiperf/.installed
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
$(CLIENTS)/inference-perf/.installed: PYBASE = $(PYTHON312)
$(CLIENTS)/aiperf/.installed: PYBASE = $(PYTHON)
$(CLIENTS)/%/.installed: $(NODE_CLIENTS)/%-requirements.txt | $(STAMP)
	rm -rf $(CLIENTS)/$*
	mkdir -p $(CLIENTS) && echo '*' > $(CLIENTS)/.gitignore
	$(PYBASE) -m venv $(CLIENTS)/$*
	$(VENV)/bin/uv pip install -q --python $(CLIENTS)/$*/bin/python --no-deps -r $<
	touch $@

# The two locks above, resolved again (after changing a version here).
lock-clients: $(STAMP)
	for t in inference-perf==0.7.0:3.12 aiperf==0.13.0:3.11; do \
		req=$${t%%:*}; out=$(NODE_CLIENTS)/$${req%%==*}-requirements.txt; \
		echo "$$req" | $(VENV)/bin/uv pip compile --python-version $${t##*:} -q \
			--no-header - -o $$out.new && \
		{ sed -n '1,2p' $$out; cat $$out.new; } > $$out.tmp && mv $$out.tmp $$out && rm $$out.new; \
	done

# torch (guidellm's data loader imports it) is .venv's own: a .pth puts .venv's site-packages
# after the venv's, so guidellm's pins win and torch is not installed twice (40 s, 1 GB).
$(GUIDELLM)/.installed: $(NODE_CLIENTS)/guidellm-requirements.txt | $(STAMP)
	rm -rf $(GUIDELLM)
	mkdir -p $(CLIENTS) && echo '*' > $(CLIENTS)/.gitignore
	$(PYTHON) -m venv $(GUIDELLM)
	$(VENV)/bin/uv pip install -q --python $(GUIDELLM)/bin/python --no-deps -r $<
	$(GUIDELLM)/bin/python -c 'import sysconfig as s; v = {"base": "$(abspath $(VENV))"}; \
		print(s.get_path("purelib", vars=v))' > $$($(GUIDELLM)/bin/python -c \
		'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-pdserve-venv.pth
	touch $@

$(NODE_CLIENTS)/node_modules/.installed: $(NODE_CLIENTS)/package.json $(NODE_CLIENTS)/package-lock.json
	cd $(NODE_CLIENTS) && npm ci --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

# nginx, redis-server, chromium: installed when root, else named (scripts/system_deps.sh).
system-deps:
	@scripts/system_deps.sh

# The image (Dockerfile) from lock/$(EXTRAS).txt; image-test runs it as overlays/cpu-dev does.
image:
	EXTRAS=$(EXTRAS) scripts/image.sh

image-test: image $(STAMP) $(NATIVE)
	PDSERVE_IMAGE=pdserve:$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)-cpu \
		$(PY) -m pytest -q tests/k8s/test_k8s_image.py

lock: $(STAMP)
	scripts/lock.sh $(VENV)/bin/uv

proto: $(STAMP)
	scripts/gen_proto.sh

# Fails when pdserve/v1/ differs from what proto/ generates.
check-proto: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	PYTHON=$(PY) scripts/gen_proto.sh $$tmp && \
	diff -r -x __pycache__ $$tmp/pdserve/v1 pdserve/v1 >/dev/null || \
	{ echo "gRPC stubs in pdserve/v1 are stale: run 'make proto' and commit"; exit 1; }
	@echo "gRPC stubs are current"

clean:
	rm -rf $(VENV) $(CLIENTS) $(NODE_CLIENTS)/node_modules models
