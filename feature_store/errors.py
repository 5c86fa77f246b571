"""Errors raised by the Feature Store. Every message names the thing, the expected and the found value.

Catch ``StoreError`` for "anything wrong with the store"; the subclasses below say what."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every Feature Store error."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The directory has no ``store.json``."""


class SchemaError(StoreError, ValueError):
    """An invalid schema definition or a schema that does not match the expected one."""


class SchemaDriftError(SchemaError):
    """Two schemas that should be identical differ (writer vs store, shard vs store)."""


class LayoutMismatchError(SchemaError):
    """The store's layout (layer ids, convention, last hidden) is not the one asked for."""


class SampleError(StoreError, ValueError):
    """A sample violates the schema (missing/unknown field, dtype, trailing shape, length)."""


class NonFiniteError(SampleError):
    """A floating field holds NaN or +-inf."""


class EmptyMaskError(SampleError):
    """A mask field has no 1 (the sample carries no training signal) or holds values other than 0/1."""


class TokenIdError(SampleError):
    """A token-id field holds a value outside ``[0, vocab_size)``."""


class CorruptShardError(StoreError):
    """A shard or commit record is foreign, truncated, missing or unparseable."""


class ChecksumError(CorruptShardError):
    """The shard's bytes do not hash to the checksum in its commit record."""


class ResumeStateError(StoreError, ValueError):
    """A reader state dict does not match the reader's settings or the store's committed shards."""


class EmptyStoreError(StoreError):
    """No committed sample to read (or none left for this rank under the remainder policy)."""
