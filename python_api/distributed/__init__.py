"""Collectives of the library: agreeing across ranks (agree.py) and the chunked all-gathers of
frozen-weight shards into pool pages (collectives.py)."""
