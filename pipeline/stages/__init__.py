"""The Ray Data stages of a job: read and parse, segment, run memory chains on an engine pool.

Each stage is a callable class handed to `map_batches`; `run.RunContext` is what every stage
knows of the run it works for."""
