"""Benchmarking a server over HTTP: `kvrelay bench`.

workloads (what is sent) -> loadgen (how, and the timings) -> metrics (statistics) -> report (table,
JSON, plots); cli holds the flags.
"""
