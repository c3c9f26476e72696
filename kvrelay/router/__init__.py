"""`kvrelay router`, the PD router: the HTTP front that pairs a prefill and a decode server per
request (app.py, routing.py, relay.py, fanout.py), chooses them (policy.py, probe.py) and adds
what one server would answer (prompt_logprobs.py, metrics.py). Above server/: it validates bodies
with the servers' schemas."""
