#!/usr/bin/env bash
# Every notebook and walkthrough on the GPU machine, as a learner runs them: each notebook's code cells in order in
# one fresh process, cells flagged `cuda` included (`slow`, `vllm` and `eval: false` cells skipped), several notebooks
# at once, all within one device command (at most 600 s there). From the repository root of the machine's copy:
#
#     JETRL_GIT_SHA=<git rev-parse --short HEAD here> bash tools/gpu_notebooks.sh         # device run, carry [".whl"]
#
# 1. installs the wheels carried in .whl/ into /tmp/site: what the notebooks import that the GPU image lacks (plotly,
#    ipywidgets, anywidget for plotly's FigureWidget, IPython, fastcore and their dependencies). Made here, once, in the repository root:
#      echo /.whl/ >> .git/info/exclude
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#        plotly==7.1.0 ipython==9.18.1 ipywidgets==8.1.9 fastcore==2.2.41 traitlets==5.16.1 comm==0.2.3 jedi==0.20.1 \
#        parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 \
#        stack-data==0.6.3 wcwidth==0.9.4 widgetsnbextension==4.0.16 jupyterlab_widgets==3.0.17 asttokens==3.0.2 \
#        executing==2.3.0 ipython_pygments_lexers==1.1.1 anywidget==0.11.0 psygnal==0.16.1          # about 20 MB
# 2. runs tools/run_notebooks.py over nbs/*.ipynb and nbs/walkthrough/*.ipynb with --flags cuda, the slowest first,
#    starting none in the last 30 s of BUDGET and killing what still runs at its end (reported NOT RUN / FAIL).
# Writes $OUT/notebooks_h200.txt (the command, date, git sha, per notebook PASS/FAIL, seconds, cells, the failing
# cell's error) and $OUT/notebooks_h200.log (every notebook's output). Without $OUT: benchmarks/results/.
# Settings by environment: BUDGET (seconds for this whole script, default 560), JOBS (notebooks at once, default 6).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
budget=${BUDGET:-560}
jobs=${JOBS:-6}
out=${OUT:-benchmarks/results}
site=${SITE:-/tmp/site}    # where the wheels go
mkdir -p "$out"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no wheels in .whl/: notebooks that import plotly, ipywidgets, IPython or fastcore fail where those are missing" >&2
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

# the notebooks that took longest on a CPU (and 05_strategies_live's benchmarks on the GPU) start first, then every
# other one in name order
first=(nbs/walkthrough/05_strategies_live.ipynb nbs/05_rollout.ipynb nbs/walkthrough/07_reproduce.ipynb nbs/walkthrough/04_grpo.ipynb
       nbs/walkthrough/06_your_task.ipynb nbs/walkthrough/03_off_policy.ipynb nbs/10_widgets.ipynb nbs/08_train.ipynb
       nbs/09_cli.ipynb nbs/08a_distributed.ipynb)
left=$(( budget - ($(date +%s) - start) ))
python3 tools/run_notebooks.py "${first[@]}" nbs/*.ipynb nbs/walkthrough/*.ipynb --flags cuda --jobs "$jobs" \
  --timeout "$left" --deadline "$left" --start-margin 30 \
  --title "Every notebook and walkthrough on the GPU machine with their cuda cells (tools/gpu_notebooks.sh)" \
  --command "JETRL_GIT_SHA=${JETRL_GIT_SHA:-unset} BUDGET=$budget JOBS=$jobs bash tools/gpu_notebooks.sh" \
  --out "$out/notebooks_h200.txt" --log "$out/notebooks_h200.log"
