"""Small synthetic visual tasks, generated on the fly, for demos, tests and benchmarks (see ``shapes``)."""
