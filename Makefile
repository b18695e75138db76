# The few commands the README names. Each one installs what it needs into .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make grade`: the assignment; left empty, it is inferred when every submitted notebook is one assignment's.
ASSIGNMENT ?=
SUBMISSIONS ?=
OUT ?= grades
# Extra options for `make grade`, e.g. GRADE_FLAGS="--workers 8 --roster roster.csv"
GRADE_FLAGS ?=
# `make translator` and `make book`: a local copy of Multi30k instead of the download (DATA_DIR=../shared/data/multi30k),
# the preset (cpu or gpu) and the run's folder.
DATA_DIR ?=
PRESET ?= cpu
RUN ?= runs/$(PRESET)-de-en
DATA_FLAG := $(if $(DATA_DIR),--data-dir $(DATA_DIR),)
# `make book`: the open edition (answers shown, for self-learners) or EDITION=class (for a graded class).
EDITION ?= open
# `make book`: the English site or BOOK_LANG=zh, the Chinese one. Not LANG: that is the shell's locale. Each site is
# built in a folder of its own; a Chinese one is then copied into its edition's English site, under zh/, where the
# published site has it:
#   open edition:  English into _build/html,                Chinese into _build/zh, copied to _build/html/zh
#   class edition: English into _build/class/_build/html,   Chinese into _build/class-zh, copied to _build/class/_build/html/zh
BOOK_LANG ?= en
BOOK_BUILD := $(if $(filter class,$(EDITION)),_build/class$(if $(filter zh,$(BOOK_LANG)),-zh,),$(if $(filter zh,$(BOOK_LANG)),_build/zh,))
BOOK_OUT := $(if $(BOOK_BUILD),--path-output $(BOOK_BUILD),)
ENGLISH_HTML := $(if $(filter class,$(EDITION)),_build/class/_build/html,_build/html)
BOOK_HTML := $(if $(filter zh,$(BOOK_LANG)),$(ENGLISH_HTML)/zh,$(ENGLISH_HTML))
# One cache of executed pages for every build (both languages, both editions): only the first executes the chapters.
EXECUTION_CACHE := $(CURDIR)/_build/.jupyter_cache

.DEFAULT_GOAL := help
.PHONY: help install book catalogues lab test lint release sync grade export new-assignment translator clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 (or run make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install the course and its tools

book: $(STAMP) ## build the site into _build/html (BOOK_LANG=zh: the Chinese site, into _build/html/zh; EDITION=class: without the answers, into _build/class/_build/html)
	@case "$(BOOK_LANG)" in en|zh) ;; *) echo "BOOK_LANG=$(BOOK_LANG): the languages are en (the default) and zh"; exit 2;; esac
	STEPFORMER_EDITION=$(EDITION) STEPFORMER_LANG=$(BOOK_LANG) STEPFORMER_EXECUTION_CACHE=$(EXECUTION_CACHE) $(if $(DATA_DIR),STEPFORMER_DATA_DIR=$(abspath $(DATA_DIR)),) $(BIN)/jupyter-book build . --warningiserror --keep-going $(BOOK_OUT)
ifeq ($(BOOK_LANG),zh)
	rm -rf $(ENGLISH_HTML)/zh && mkdir -p $(ENGLISH_HTML) && cp -r $(BOOK_BUILD)/_build/html $(ENGLISH_HTML)/zh
	@$(BIN)/python -m stepformer.course.catalogues stat
endif
	@echo "Open: file://$(CURDIR)/$(BOOK_HTML)/index.html"

catalogues: $(STAMP) ## extract the book's and the checks' messages again into the Chinese catalogues, after English changes
	STEPFORMER_EXECUTION_CACHE=$(EXECUTION_CACHE) $(BIN)/python -m stepformer.course.catalogues update
	@$(BIN)/python -m stepformer.course.catalogues stat
	@# The checks' catalogues (src/stepformer/checks/locale): what still needs a Chinese entry is listed, not fatal here.
	-@$(BIN)/python -m stepformer.course.catalogues checks --update

# `make lab`: the folder it opens, and options for jupyter lab (tests/test_lab.py: --no-browser, a port, a token).
LAB_DIR ?= exercises/
LAB_FLAGS ?=
# Students get nbgrader's Validate button, nothing of the instructors' tools (formgrader, the
# create-assignment toolbar, the course and assignment lists, which need nbgrader's exchange).
# They are switched off for this server alone, by a Jupyter config folder that JUPYTER_CONFIG_PATH
# puts before the environment's: the instructor's own `jupyter lab` keeps them.
STUDENT_JUPYTER := _build/student-jupyter
lab: $(STAMP) ## open JupyterLab on the student exercises
	@mkdir -p $(STUDENT_JUPYTER)/labconfig
	@echo '{"disabledExtensions": {"@jupyter/nbgrader:formgrader": true, "@jupyter/nbgrader:create-assignment": true,' \
		'"@jupyter/nbgrader:course-list": true, "@jupyter/nbgrader:assignment-list": true,' \
		'"@jupyter/nbgrader:menu": true}}' \
		> $(STUDENT_JUPYTER)/labconfig/page_config.json
	@echo '{"ServerApp": {"jpserver_extensions": {"nbgrader.server_extensions.formgrader": false,' \
		'"nbgrader.server_extensions.course_list": false, "nbgrader.server_extensions.assignment_list": false}}}' \
		> $(STUDENT_JUPYTER)/jupyter_server_config.json
	JUPYTER_CONFIG_PATH=$(CURDIR)/$(STUDENT_JUPYTER)$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH),) \
		$(BIN)/jupyter lab $(LAB_FLAGS) $(LAB_DIR)

test: $(STAMP) ## run the whole test suite (what CI runs)
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

lint: $(STAMP) ## ruff on the library, the tests and the notebooks
	$(BIN)/ruff check .

sync: $(STAMP) ## copy library functions into the solution cells, then regenerate exercises/
	$(BIN)/stepformer-course sync
	$(BIN)/stepformer-course release

release: $(STAMP) ## regenerate exercises/ from solutions/ with nbgrader
	$(BIN)/stepformer-course release

export: $(STAMP) ## every student x assignment: make export FORMAT=csv|canvas|moodle [ROSTER=roster.csv [ALL_STUDENTS=1]]
	$(BIN)/stepformer-course export --format $(or $(FORMAT),csv) --out "$(OUT)/course-$(or $(FORMAT),csv).csv" $(if $(ROSTER),--roster "$(ROSTER)",) $(if $(ALL_STUDENTS),--all-students,)

new-assignment: $(STAMP) ## start an assignment of your own: make new-assignment NAME=12_tokenizers
	@test -n "$(NAME)" || { echo "usage: make new-assignment NAME=<two digits>_<topic>"; exit 2; }
	$(BIN)/stepformer-course new-assignment "$(NAME)"

grade: $(STAMP) ## grade SUBMISSIONS (a folder or a .zip) for ASSIGNMENT into OUT
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=<folder or zip> [ASSIGNMENT=01_attention] [OUT=grades] [GRADE_FLAGS=...]"; exit 2; }
	$(BIN)/stepformer-course grade "$(SUBMISSIONS)" $(if $(ASSIGNMENT),--assignment $(ASSIGNMENT),) --out "$(OUT)" $(GRADE_FLAGS)

translator: $(STAMP) ## train the translator (PRESET=cpu: ~50 min on a CPU), then print its test scores
	$(BIN)/stepformer-translate train --preset $(PRESET) --out $(RUN) $(DATA_FLAG) $(if $(wildcard $(RUN)/checkpoints),--resume,)
	$(BIN)/stepformer-translate evaluate --checkpoint $(RUN)/averaged.pt --split test_2016_flickr $(DATA_FLAG)

clean: ## remove the built site (keeps .venv and the grading folders, whose gradebooks hold manual grades)
	rm -rf _build
	@test ! -d autograder/work || echo "kept autograder/work (gradebooks, manual grades): delete it yourself when the term is over"
