"""Prefill-decode disaggregation: protocol, transfer agents (sender/receiver), transports."""
