"""Where a memory chain loses a needle: in the update that should write it, or in a later one.

For each NIAH sample and template set, two single update calls:
- *write*: the initial memory and the section that holds the needle;
- *keep*: a memory that holds the needle and the next section, which does not.
A reply passes when it contains the needle's number.

    .venv/bin/python bench/needle_update_probe.py [--model M] [--length 32768] [--samples 3]
        [--templates memagent-reference,segment-first] [--chunk-size 5000]
"""

from __future__ import annotations

import argparse
import asyncio

from connectors.engines.factory import DEFAULT_MODEL, EngineSpec, load_tokenizer, open_engine
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from operators.core.templates import get_template_set
from operators.engine import GenerationRequest
from pipeline.evaluation import corpora
from pipeline.evaluation.haystack import HaystackCorpus
from pipeline.evaluation.niah import NiahBuilder


async def main(args: argparse.Namespace) -> None:
    spec = EngineSpec(model=args.model, enforce_eager=True, max_model_len=args.chunk_size + 2048)
    tokenizer = load_tokenizer(spec)
    builder = NiahBuilder(
        HaystackCorpus(corpora.load_texts(corpora.DEFAULT_CORPORA), tokenizer), tokenizer
    )
    samples = builder.build(args.length, args.samples, seed=0, length_label=str(args.length))
    cases = []  # (template, sample id, probe, value, prompt)
    for sample in samples:
        document = tokenize(sample.sample_id, sample.document, tokenizer)
        segments = segment(document, tokenizer, SegmentationConfig(chunk_size=args.chunk_size))
        needle, value = sample.details["needles"][0], sample.answers[0]
        holder = next(s for s in segments if needle in s.text)
        after = next((s for s in segments[holder.index + 1 :] if needle not in s.text), None)
        for name in args.templates.split(","):
            templates = get_template_set(name)
            write = templates.render_update(sample.question, templates.initial_memory, holder.text)
            cases.append((name, sample.sample_id, "write", value, write))
            if after is not None:
                keep = templates.render_update(sample.question, needle, after.text)
                cases.append((name, sample.sample_id, "keep", value, keep))
    engine = open_engine(spec)
    try:
        replies = await asyncio.gather(
            *(
                engine.generate(GenerationRequest(f"{name}|{sample_id}|{probe}", prompt, 256))
                for name, sample_id, probe, _value, prompt in cases
            )
        )
    finally:
        await engine.shutdown()
    passed: dict[tuple[str, str], list[bool]] = {}
    for (name, _sample_id, probe, value, _prompt), reply in zip(cases, replies, strict=True):
        passed.setdefault((name, probe), []).append(value in reply.text)
        print(f"{reply.request_id}: {reply.text[:120]!r}")
    print(f"{args.model}, {args.samples} samples of {args.length} tokens, chunk {args.chunk_size}")
    for (name, probe), hits in passed.items():
        print(f"{name} {probe}: {sum(hits)}/{len(hits)} replies hold the needle's number")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--templates", default="memagent-reference,segment-first")
    parser.add_argument("--chunk-size", type=int, default=5000)
    asyncio.run(main(parser.parse_args()))
