"""Executors run cells and hand back rows: in this process (``local``), one fresh process per cell
(``local.SubprocessExecutor`` with the ``worker`` entry point), or on a Ray cluster (``ray``)."""
