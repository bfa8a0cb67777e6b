import attnbench_refusals_absent_hash  # noqa: F401

ENGINE = "engine"
