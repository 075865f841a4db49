"""Data: the embedded corpus, file readers, packing into samples, and step loading."""

from lmforge.data.corpus import embedded_corpus
from lmforge.data.loader import StepLoader, eval_batches
from lmforge.data.packing import (
    IGNORE_INDEX,
    Batch,
    PackedTokenDataset,
    Sample,
    SampleDataset,
    collate,
)
from lmforge.data.sources import read_documents, read_jsonl_records

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "PackedTokenDataset",
    "Sample",
    "SampleDataset",
    "StepLoader",
    "collate",
    "embedded_corpus",
    "eval_batches",
    "read_documents",
    "read_jsonl_records",
]
