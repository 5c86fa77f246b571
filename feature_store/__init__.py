"""Feature Store: target-model hidden states on disk for drafter training (docs/design/formats.md section 1).

Imports torch, numpy and safetensors-compatible files only; nothing of ours, no engine, no CUDA."""

from feature_store.errors import (
                                  ChecksumError,
                                  CorruptShardError,
                                  EmptyMaskError,
                                  EmptyStoreError,
                                  LayoutMismatchError,
                                  NonFiniteError,
                                  ResumeStateError,
                                  SampleError,
                                  SchemaDriftError,
                                  SchemaError,
                                  StoreError,
                                  StoreNotFoundError,
                                  TokenIdError,
)
from feature_store.index import StoreIndex
from feature_store.reader import StoreReader
from feature_store.schema import FieldSpec, Layout, Schema, standard_schema
from feature_store.store import CommitRecord, StoreMeta, load_store
from feature_store.writer import StoreWriter

__all__ = [
    "ChecksumError", "CommitRecord", "CorruptShardError", "EmptyMaskError", "EmptyStoreError", "FieldSpec",
    "Layout", "LayoutMismatchError", "NonFiniteError", "ResumeStateError", "SampleError", "Schema",
    "SchemaDriftError", "SchemaError", "StoreError", "StoreIndex", "StoreMeta", "StoreNotFoundError",
    "StoreReader", "StoreWriter", "TokenIdError", "load_store", "standard_schema",
]
