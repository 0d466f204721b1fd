"""What happens to one record, with no Ray and no I/O but the bytes handed in.

The bottom layer: the MemAgent method (`core`: records, segmentation, prompts, chains, quotes,
evidence, re-read), parsing (`parsing`), the method settings (`config`), the `Engine` interface
(`engine`) and the loop that drives chains against any engine (`runner`).
"""
