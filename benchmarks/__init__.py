"jetrl's benchmarks: `python -m benchmarks` lists them, `python -m benchmarks <name> --help` shows one's options."
