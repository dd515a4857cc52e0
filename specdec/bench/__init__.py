"""Benchmarks and measuring tools, one module per concept (imported by the CLI and tools/, nothing else):

    prompts   prompt sets (Spec-Bench / JSONL rows, round-robin picks, chat encoding)
    machine   machine facts: CPU, threads, memory bandwidth (the batch-1 roofline)
    engines   the engines timed on the same token ids: specdec, transformers
    offline   `specdec bench`: batch-1 A/B runs, batch sizes, dtypes, comparisons, roofline
    serve     `specdec bench --serve`: load test of the OpenAI-compatible server, speculative vs plain
    tune      `specdec tune`: measure draft shapes per batch size, write the dispatcher's table
    report    plain-text tables and lines of a report, and where results are written
"""
