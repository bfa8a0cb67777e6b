import attnbench_refusals_absent_kernels  # noqa: F401
