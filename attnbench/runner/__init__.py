"""Running sweeps: a sweep's grid (``sweep``), the tensors of one cell (``workload``), one cell to one row
(``cell``), the run as a whole (``engine``: ``attnbench.run``), and where cells run (``executors``)."""
