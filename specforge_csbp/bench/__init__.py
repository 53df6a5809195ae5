"""Benchmark records (design.md section 8) and what is generated from them."""

from .records import BenchRecord, load_records, write_records

__all__ = ["BenchRecord", "load_records", "write_records"]
