# Fresh machine:  make test   (sets up .venv first)   |   make demo   (the main job)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMPS := $(VENV)/.stamps
BUILD  := .build
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Large wheels (torch, triton: ~300 MB) over a flaky link: a CI run once failed on a download cut
# six times at the same byte. pip resumes a cut download; let it try longer, and retry the whole
# install (below) when even that gives up.
export PIP_RETRIES := 10
export PIP_TIMEOUT := 60
export PIP_RESUME_RETRIES := 30
PIP_INSTALL = for try in 1 2 3; do $(BIN)/pip install $(1) && break; \
  [ $$try = 3 ] && exit 1; echo "pip install failed (try $$try of 3); retrying in 20 s" >&2; sleep 20; done
export PYTHONDONTWRITEBYTECODE := 1
# CPU runs: rendering of the simulator goes through EGL, no display needed.
export MUJOCO_GL ?= egl

PKG_SOURCES := $(shell find vla_accel_ros config launch bundles -type f -not -name '*.pyc' -not -path '*/__pycache__/*' 2>/dev/null)
MSG_SOURCES := $(wildcard msg/*.msg) CMakeLists.txt cmake/pypi_wheels.cmake package.xml

.PHONY: help setup test test-slow demo clean lint

help:
	@echo "make setup      create $(VENV), install dependencies, build msg/, install the package"
	@echo "make test       run the test suite (sets up first when needed)"
	@echo "make test-slow  also run the tests marked slow"
	@echo "make demo       the main job: demo bundles, replay benchmark, closed loop"

setup: $(STAMPS)/package $(STAMPS)/triton

$(STAMPS)/venv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	mkdir -p $(STAMPS) && touch $@

# MuJoCo renders through EGL (Mesa on CPU). Present on the development image; installed from
# Debian when a fresh machine lacks it.
SYSTEM_PKGS := libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0
$(STAMPS)/system: | $(STAMPS)/venv
	if ! ldconfig -p | grep -q 'libEGL_mesa.so.0'; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(SYSTEM_PKGS); \
	fi
	touch $@

$(STAMPS)/deps: $(STAMPS)/system requirements.txt requirements-ros.txt requirements-sim.txt requirements-dev.txt $(STAMPS)/venv
	$(call PIP_INSTALL,-q -r requirements.txt -r requirements-ros.txt -r requirements-sim.txt -r requirements-dev.txt)
	touch $@

# Triton for the GPU kernels' tests only, outside site-packages (see requirements-triton.txt).
$(STAMPS)/triton: requirements-triton.txt $(STAMPS)/venv
	rm -rf $(VENV)/triton
	$(call PIP_INSTALL,-q --no-deps --target $(VENV)/triton -r requirements-triton.txt)
	touch $@

# The real rosidl pipeline, configured against the venv as the ament prefix.
$(STAMPS)/msgs: $(MSG_SOURCES) $(STAMPS)/deps
	mkdir -p $(BUILD) && source $(BIN)/activate && export AMENT_PREFIX_PATH="$$VIRTUAL_ENV" && \
	cmake -S . -B $(BUILD)/msgs -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$VIRTUAL_ENV" -DCMAKE_INSTALL_PREFIX="$$VIRTUAL_ENV" \
	  -DBUILD_TESTING=OFF -DVLA_ACCEL_ROS_INSTALL_PYTHON=OFF \
	  -DPython3_EXECUTABLE="$$VIRTUAL_ENV/bin/python" > $(BUILD)/msgs-configure.log 2>&1 \
	  || { cat $(BUILD)/msgs-configure.log; exit 1; }
	$(BIN)/cmake --build $(BUILD)/msgs --target install > $(BUILD)/msgs-build.log 2>&1 \
	  || { tail -50 $(BUILD)/msgs-build.log; exit 1; }
	@# ament_python_install_package leaves an egg-info claiming the whole vla_accel_ros
	@# directory; pip would uninstall the generated interfaces along with it.
	rm -rf "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/vla_accel_ros-*.egg-info
	touch $@

# A regular (non-editable) install: the package and the generated interfaces share one
# site-packages/vla_accel_ros directory, exactly as in a colcon install space. Rebuilt when any
# source changes; the msg build rewrites that directory's __init__.py, so it comes first.
$(STAMPS)/package: $(STAMPS)/msgs setup.py setup.cfg $(PKG_SOURCES)
	$(BIN)/pip install -q --no-deps --no-build-isolation .
	rm -rf build *.egg-info
	touch $@

# Upstream ROS 2 Jazzy launch and CLI (launch, launch_ros, launch_testing, ros2cli: not on PyPI),
# when ../shared/ros2-jazzy is beside the checkout (its README): the wheels, built unmodified from
# the upstream jazzy branches, and composition_interfaces (which launch_ros imports) built from its
# source with the rosidl pipeline and include-dir fix of msg/. test/test_ros2_launch*.py run
# `ros2 launch` with them and skip without them.
ROS2_JAZZY   ?= ../shared/ros2-jazzy
ROS2_WHEELS  := $(sort $(wildcard $(ROS2_JAZZY)/wheels/*.whl))
ROS2_SOURCES := $(shell find $(ROS2_JAZZY)/src -type f 2>/dev/null)
ifneq ($(ROS2_WHEELS),)
setup: $(STAMPS)/ros2-jazzy
endif

$(STAMPS)/ros2-jazzy: $(ROS2_WHEELS) $(ROS2_SOURCES) cmake/pypi_wheels.cmake cmake/pypi_wheels_project_include.cmake $(STAMPS)/deps
	cd $(ROS2_JAZZY)/wheels && sha256sum --quiet -c SHA256SUMS
	@# --no-deps: launch_ros declares ament_index_python, which the venv has as ros-jazzy-ament-index-python.
	$(BIN)/pip install -q --no-deps --force-reinstall $(ROS2_WHEELS)
	mkdir -p $(BUILD) && source $(BIN)/activate && export AMENT_PREFIX_PATH="$$VIRTUAL_ENV" && \
	cmake -S $(ROS2_JAZZY)/src/composition_interfaces -B $(BUILD)/composition_interfaces -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$$VIRTUAL_ENV" -DCMAKE_INSTALL_PREFIX="$$VIRTUAL_ENV" \
	  -DBUILD_TESTING=OFF -DCMAKE_PROJECT_INCLUDE="$(CURDIR)/cmake/pypi_wheels_project_include.cmake" \
	  -DPython3_EXECUTABLE="$$VIRTUAL_ENV/bin/python" > $(BUILD)/composition_interfaces-configure.log 2>&1 \
	  || { cat $(BUILD)/composition_interfaces-configure.log; exit 1; }
	$(BIN)/cmake --build $(BUILD)/composition_interfaces --target install > $(BUILD)/composition_interfaces-build.log 2>&1 \
	  || { tail -50 $(BUILD)/composition_interfaces-build.log; exit 1; }
	$(BIN)/python -c 'import launch_ros.actions, ros2cli, launch_testing, composition_interfaces.srv'
	touch $@

test: setup
	$(BIN)/pytest -q

test-slow: setup
	$(BIN)/pytest -q -m "slow or not slow"

demo: setup
	$(BIN)/vla-accel demo

clean:
	rm -rf $(VENV) $(BUILD) build *.egg-info
