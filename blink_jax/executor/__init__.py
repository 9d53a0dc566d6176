"""The executor: the serving loop as one XLA program (`loop`), the XLA flags it needs before
JAX starts (`xla_flags`) and the report of whether the loop runs as a device WHILE node
(`loop_report`)."""
