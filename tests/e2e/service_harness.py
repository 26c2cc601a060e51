"""The old name of e2e_support, kept only for bench/chaos.py and bench/soak.py, which import
`MODEL` and `run_service` from it: delete this file once they import e2e_support."""

from e2e_support import MODEL, run_service

__all__ = ["MODEL", "run_service"]
