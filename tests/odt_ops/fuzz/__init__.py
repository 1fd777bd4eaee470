"""A structure-aware fuzzer of the files odt_ops reads from untrusted sources (see run.py)."""
