"""The GPU check, in one command on the GPU machine: the GPU tests and the kernel tests, then the speed bounds.

    python -m benchmarks check                                  # tests, then speed_check (its rows printed)
    python -m benchmarks check --out benchmarks/results/speed_check_h200.jsonl
    python -m benchmarks check --tests-only | --speed-only

1. `python -m pytest -q tests/test_gpu.py tests/test_kernels.py tests/test_grad_kernels.py tests/test_gluon_kernels.py`
   (correctness: kernels against the CPU oracle and each other, engine == trainer, the graphed trainer), stopped by
   SIGINT at --test-timeout so that pytest still prints its summary;
2. with `--notebooks FILE`: every notebook and walkthrough, cells flagged `cuda` included, each in a fresh process
   (`python tools/run_notebooks.py --flags cuda --out FILE`: per notebook PASS / FAIL and seconds);
3. `python -m benchmarks speed_check` (each kernel against what it replaces, timed and bounded).
The exit status is 0 only if all pass. A tree copied without .git: set JETRL_GIT_SHA for the rows' `git_sha`.
"""
import argparse, os, signal, subprocess, sys

TESTS = ["tests/test_gpu.py", "tests/test_kernels.py", "tests/test_grad_kernels.py", "tests/test_gluon_kernels.py"]
# NVLink multicast off (the GPU machines' settings for NCCL and symmetric memory)
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}


def run_tests(extra: list[str], timeout_s: int) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *TESTS, *extra]
    print("+ " + " ".join(command), flush=True)
    proc = subprocess.Popen(command, env=os.environ | ENV)
    try: return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)                 # pytest stops and still prints its summary
        try: proc.wait(timeout=30)
        except subprocess.TimeoutExpired: proc.kill()
        return 124


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks check", description=__doc__.split("\n")[0])
    p.add_argument("--tests-only", action="store_true")
    p.add_argument("--speed-only", action="store_true")
    p.add_argument("--test-timeout", type=int, default=420, help="seconds before the tests are interrupted")
    p.add_argument("-k", default=None, help="pytest -k expression for the tests")
    p.add_argument("--out", "--results", dest="out", default=None, metavar="FILE", help="append speed_check's rows to FILE")
    p.add_argument("--notebooks", default=None, metavar="FILE",
                   help="also run every notebook with its cuda cells (tools/run_notebooks.py), the report in FILE")
    args = p.parse_args(argv)
    os.environ.update(ENV)
    status = 0
    if not args.speed_only:
        status = run_tests(["-k", args.k] if args.k else [], args.test_timeout)
        print(f"tests: exit status {status}", flush=True)
    if args.notebooks and not args.speed_only:
        command = [sys.executable, "tools/run_notebooks.py", "--flags", "cuda", "--out", args.notebooks]
        print("+ " + " ".join(command), flush=True)
        notebooks = subprocess.run(command).returncode
        print(f"notebooks: exit status {notebooks}", flush=True)
        status = status or notebooks
    if not args.tests_only:
        from benchmarks import speed_check
        speed = speed_check.main(["--out", args.out] if args.out else [])
        status = status or speed
    return status


if __name__ == "__main__":
    sys.exit(main())
