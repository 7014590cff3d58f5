"""Side-by-side CPU benchmarks: PyTorch eager, torch.compile and ortrain on the same workloads,
in one run (`python -m bench`, see bench/README.md). Also the stand-alone scripts
tutorial_demo.py and logging_overhead.py."""
