"""The run ledger: every bench/verify/ab/repro run in one SQLite file with the server's full
configuration and the environment it ran in; `kvrelay report` turns it into a status report.

store (the file) <- record (what a run stores: server info fetched over HTTP, the client's
environment) ; configs (naming and comparing server configurations) ; report (Markdown) ; cli.
"""

from kvrelay.ledger.record import record_run

__all__ = ["record_run"]
