"""`memstream eval`: long-context benchmarks built from real texts, run on memory chains and on
the model reading the document directly.

Task builders (`hotpotqa`, `niah`, `cuad`) are pure given texts and a tokenizer; `corpora` reads
the shared files; `execution` runs one configuration's samples against an engine; `suite`
schedules configurations under a time budget; `report` writes JSON, Markdown and a plot.
`request` is what `memstream eval` is asked and the metadata a run records; `resuming` says when
a run may continue an earlier one's results; `run` builds a run's samples, runs its
configurations on an open engine, and re-grades a finished run.
"""
