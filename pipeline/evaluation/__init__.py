"""`memstream eval`: long-context benchmarks built from real texts, run on memory chains and on
the model reading the document directly.

Task builders (`hotpotqa`, `niah`, `cuad`) are pure given texts and a tokenizer; `corpora` reads
the shared files; `execution` runs one configuration's samples against an engine; `suite`
schedules configurations under a time budget; `report` writes JSON, Markdown and a plot.
"""
